"""The shipped deploy files, checked offline: Kubernetes manifests against their schemas (the
validator's own, and KEDA's and the Prometheus operator's vendored in deploy/k8s/schemas), the
compose file's services and settings, the Dockerfile's users; and the shipped Redis config run
for real: no access without the password, a run goes through with it. The probes the manifests
ship are run against real workers, and a tool worker's processes are watched for litellm.
(No container engine runs here: the image and compose file are checked as files, not run.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from orchestrator.keys import Keys
from orchestrator.local import free_port
from tests.conftest import ROOT, start_redis
from tests.helpers import READY_S, call, tools, wait_for
from worker.launcher import SHUTDOWN_GRACE_S

K8S = ROOT / "deploy" / "k8s"
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_v1alpha1_ScaledObject.json",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): "keda.sh_v1alpha1_TriggerAuthentication.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_v1_ServiceMonitor.json",
}


def kustomize(folder: Path) -> list[dict[str, Any]]:
    """The objects a kustomization lists, resources followed recursively (no patches are used)."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(spec) <= {"apiVersion", "kind", "resources", "labels", "images"}, "unsupported kustomize field"
    docs: list[dict[str, Any]] = []
    for resource in spec["resources"]:
        path = folder / resource
        assert path.exists(), f"{folder}/kustomization.yaml lists {resource}, which does not exist"
        if path.is_dir():
            docs += kustomize(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def objects(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


VARIANTS = [K8S, K8S / "hpa"]


def validate(doc: dict[str, Any]) -> None:
    """Against the Kubernetes schemas the validator ships, or the vendored CRD schema."""
    import jsonschema
    import kubernetes_validate

    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_SCHEMAS:
        jsonschema.validate(doc, json.loads((K8S / "schemas" / CRD_SCHEMAS[key]).read_text()))
    else:  # strict: any unknown field fails
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("variant", VARIANTS, ids=["keda", "hpa"])
def test_manifests_validate_against_their_schemas(variant: Path) -> None:

    docs = kustomize(variant)
    for doc in docs:
        validate(doc)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "PodDisruptionBudget", "NetworkPolicy", "Service"} <= kinds
    assert ("ScaledObject" in kinds) == (variant == K8S)
    assert ("HorizontalPodAutoscaler" in kinds) == (variant != K8S)


@pytest.mark.parametrize("variant", VARIANTS, ids=["keda", "hpa"])
def test_kustomize_itself_builds_the_same_objects_and_they_validate(variant: Path) -> None:
    """The real build (`kubectl kustomize`, offline), not only this file's reading of it."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomize build itself is not checked here")
    out = subprocess.run([kubectl, "kustomize", str(variant)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    built = [d for d in yaml.safe_load_all(out.stdout) if d]
    names = sorted((d["kind"], d["metadata"]["name"]) for d in built)
    assert names == sorted((d["kind"], d["metadata"]["name"]) for d in kustomize(variant))
    for doc in built:
        validate(doc)
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tooloop"


def test_a_validator_catches_a_broken_manifest() -> None:
    """The check above can fail: a misspelt field is refused by each kind of schema."""
    import jsonschema
    import kubernetes_validate

    docs = kustomize(K8S)
    broken = json.loads(json.dumps(objects(docs, "Deployment")["tooloop-turns"]))
    pod(broken)["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)
    scaled = json.loads(json.dumps(objects(docs, "ScaledObject")["tooloop-tools"]))
    scaled["spec"]["maxReplicas"] = 5
    schema = json.loads((K8S / "schemas" / CRD_SCHEMAS[("keda.sh/v1alpha1", "ScaledObject")]).read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, schema)


def test_every_manifest_file_is_listed() -> None:
    listed = {(K8S / "base" / r).resolve() for r in yaml.safe_load((K8S / "base" / "kustomization.yaml")
                                                                   .read_text())["resources"]}  # fmt: skip
    on_disk = {p.resolve() for p in (K8S / "base").glob("*.yaml") if p.name != "kustomization.yaml"}
    assert on_disk == listed


def test_manifests_say_what_the_code_does() -> None:
    docs = kustomize(K8S)
    deployments = objects(docs, "Deployment")
    turns, tools = deployments["tooloop-turns"], deployments["tooloop-tools"]
    keys = Keys(objects(docs, "ConfigMap")["tooloop"]["data"]["TOOLOOP_KEY_PREFIX"])
    # separate pools, each on its own queue, each scaled on the calls waiting for it
    assert pod(turns)["containers"][0]["args"][:3] == ["worker", "-Q", "turns"]
    assert pod(tools)["containers"][0]["args"][:3] == ["worker", "-Q", "tools"]
    scaled = objects(docs, "ScaledObject")
    for name in ("tooloop-turns", "tooloop-tools"):
        assert scaled[name]["spec"]["scaleTargetRef"]["name"] == name
        assert len(scaled[name]["spec"]["triggers"]) == 1
    # turns wait in one Redis list
    trigger = scaled["tooloop-turns"]["spec"]["triggers"][0]
    assert trigger["type"] == "redis"
    assert trigger["metadata"]["listName"] == keys.broker_prefix + keys.turn_queue
    assert trigger["metadata"]["username"] == "tooloop"
    # tool calls wait in the shared list and in one list per tool (orchestrator.dispatch.call_queue):
    # the tools pool scales on the gauge that sums them all, as the pods export it
    assert keys.tool_queue_of("add") != keys.tool_queue
    trigger = scaled["tooloop-tools"]["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["query"] == f'max(tooloop_queue_depth{{queue="{keys.tool_queue}"}})'
    assert trigger["metadata"]["serverAddress"].startswith("http://")
    assert float(trigger["metadata"]["threshold"]) > 0
    # a pod is killed only after the launcher's warm shutdown had its time
    for d in (turns, tools):
        assert pod(d)["terminationGracePeriodSeconds"] > SHUTDOWN_GRACE_S
        container = pod(d)["containers"][0]
        assert container["resources"]["requests"]["memory"] and container["resources"]["limits"]["memory"]
        assert "--metrics-port" in container["args"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
        assert "inspect ping" in " ".join(container["livenessProbe"]["exec"]["command"])
    # only the tool worker runs as root; the API and Flower never do
    assert pod(tools)["securityContext"]["runAsUser"] == 0
    for name in ("tooloop-turns", "tooloop-api", "tooloop-flower"):
        assert pod(deployments[name])["securityContext"]["runAsNonRoot"] is True
    # Flower and the API are behind authentication
    flower_env = env_of(pod(deployments["tooloop-flower"])["containers"][0])
    assert flower_env["FLOWER_BASIC_AUTH"]["secretKeyRef"]["key"] == "flower-basic-auth"
    assert env_of(pod(deployments["tooloop-api"])["containers"][0])["TOOLOOP_API_TOKENS"]["secretKeyRef"]
    # every pod that talks to Redis authenticates, and may pass the NetworkPolicy; nothing else may
    clients = set()
    for name, d in deployments.items():
        env = env_of(pod(d)["containers"][0])
        assert env["TOOLOOP_REDIS_URL"] == "redis://tooloop:$(REDIS_PASSWORD)@tooloop-redis:6379/0", name
        assert list(env).index("REDIS_PASSWORD") < list(env).index("TOOLOOP_REDIS_URL")  # $(...) expands
        assert d["spec"]["template"]["metadata"]["labels"]["tooloop.dev/redis-client"] == "true"
        clients.add(name)
    assert clients == {"tooloop-turns", "tooloop-tools", "tooloop-api", "tooloop-flower"}
    policy = objects(docs, "NetworkPolicy")["tooloop-redis"]["spec"]
    redis = objects(docs, "StatefulSet")["tooloop-redis"]
    redis_labels = redis["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= redis_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    sources = policy["ingress"][0]["from"]
    assert sources[0] == {"podSelector": {"matchLabels": {"tooloop.dev/redis-client": "true"}}}
    assert all("podSelector" in s for s in sources)  # no source admits whole namespaces
    # the Redis pods run the shipped config and entrypoint, byte for byte, with a volume
    conf = objects(docs, "ConfigMap")["tooloop-redis"]["data"]
    assert conf["redis.conf"] == (ROOT / "deploy" / "redis.conf").read_text()
    directives = [line.split() for line in conf["redis.conf"].splitlines()]
    assert ["appendonly", "yes"] in directives  # a run's state survives a Redis restart
    assert ["maxmemory-policy", "noeviction"] in directives  # and is never evicted for room
    assert conf["redis-entrypoint.sh"] == (ROOT / "deploy" / "redis-entrypoint.sh").read_text()
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert env_of(pod(redis)["containers"][0])["REDIS_PASSWORD"]["secretKeyRef"]["key"] == "redis-password"
    # each worker pod exposes metrics that the ServiceMonitor scrapes
    monitor = objects(docs, "ServiceMonitor")["tooloop"]["spec"]
    metrics_svc = objects(docs, "Service")["tooloop-worker-metrics"]
    assert metrics_svc["metadata"]["labels"]["app.kubernetes.io/name"] in monitor["selector"][
        "matchExpressions"][0]["values"]  # fmt: skip
    assert {e["port"] for e in monitor["endpoints"]} >= {p["name"] for p in metrics_svc["spec"]["ports"]}
    budgets = {b["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] for b in objects(
        docs, "PodDisruptionBudget").values()}  # fmt: skip
    assert {"tooloop-turns", "tooloop-tools", "tooloop-api"} <= budgets


# -- compose ------------------------------------------------------------------------------------
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_file_matches_the_compose_specification() -> None:
    """The Compose Specification's JSON schema (vendored from compose-spec, as docker-compose
    1.29.2 ships it): no misspelt key or wrong type passes; no container engine runs here."""
    import jsonschema

    validator = jsonschema.Draft201909Validator(json.loads((ROOT / "deploy" / "schemas" /
                                                            "compose_spec.json").read_text()))  # fmt: skip
    assert list(validator.iter_errors(compose())) == []
    broken = compose()
    broken["services"]["worker-tools"]["stop_grace_periode"] = "40s"
    broken["services"]["api"]["ports"] = "8080:8080"
    assert len(list(validator.iter_errors(broken))) == 2


def test_compose_services_and_settings() -> None:
    doc = compose()
    services = doc["services"]
    assert {"redis", "worker-turns", "worker-tools", "api", "flower"} <= set(services)
    optional = {n for n, s in services.items() if s.get("profiles") == ["observability"]}
    assert {"otel-collector", "prometheus", "grafana"} <= optional
    turns, tools = services["worker-turns"], services["worker-tools"]
    assert turns["command"][:3] == ["worker", "-Q", "turns"]
    assert tools["command"][:3] == ["worker", "-Q", "tools"]
    for worker in (turns, tools):
        # `--scale` needs replicas that differ: no fixed name, no published port
        assert "container_name" not in worker and "ports" not in worker
        assert _seconds(worker["stop_grace_period"]) > SHUTDOWN_GRACE_S
        assert "--metrics-port" in worker["command"]
    assert tools["user"] == "0" and "user" not in services["api"] and "user" not in services["flower"]
    assert "user" not in turns  # turn workers run tools nowhere: the image's unprivileged user
    # every tooloop service reaches Redis as user tooloop, with the required password
    env = doc["x-tooloop-env"]
    assert env["TOOLOOP_REDIS_URL"] == "redis://tooloop:${REDIS_PASSWORD:?set REDIS_PASSWORD}@redis:6379/0"
    assert services["redis"]["entrypoint"] == ["/usr/local/bin/tooloop-redis"]
    assert "./deploy/redis-entrypoint.sh:/usr/local/bin/tooloop-redis:ro" in services["redis"]["volumes"]
    assert services["flower"]["environment"]["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH:?")
    assert services["api"]["environment"]["TOOLOOP_API_TOKENS"].startswith("${TOOLOOP_API_TOKENS:?")
    # the files the services mount are in the repository
    for service in services.values():
        for volume in service.get("volumes", []):
            if volume.startswith("./"):
                assert (ROOT / volume.split(":")[0]).exists(), volume


def _seconds(duration: str) -> int:
    match = re.fullmatch(r"(\d+)s", duration)
    assert match, duration
    return int(match[1])


def test_the_image_runs_the_api_and_flower_unprivileged() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert "'.[otel]'" in text


def test_the_dashboard_shows_what_the_issue_asks_from_metrics_that_exist() -> None:
    from orchestrator import metrics

    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    wanted = {"Runs ended by exit", "Turn latency", "Tool duration", "Queue depth", "Tokens per minute"}
    assert wanted <= titles
    counted = {m._name for m in vars(metrics.metrics()).values()}  # what workers count
    fleet = {"tooloop_queue_depth", "tooloop_live_runs", "tooloop_paused_runs", "tooloop_redis_up"}
    defined = counted | fleet
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used = set(re.findall(r"tooloop_\w+", target["expr"]))
            base = {re.sub(r"_(total|bucket|count|sum)$", "", n) for n in used}
            assert base and base <= defined, (panel["title"], target["expr"])


# -- the shipped Redis, for real ----------------------------------------------------------------
@pytest.fixture
def shipped_redis() -> Any:
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed")
    folder = Path(tempfile.mkdtemp(prefix="tooloop-redis-auth-"))
    port, password = free_port(), "Zq8Vt3kX9pLm2Rw7"
    env = {**os.environ, "REDIS_PASSWORD": password, "REDIS_CONF": str(ROOT / "deploy" / "redis.conf"),
           "REDIS_ACL_FILE": str(folder / "users.acl")}  # fmt: skip
    proc = subprocess.Popen(["sh", str(ROOT / "deploy" / "redis-entrypoint.sh"), "--port", str(port),
                             "--bind", "127.0.0.1", "--dir", str(folder)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # fmt: skip
    import redis

    anonymous = redis.Redis(port=port, socket_timeout=5)

    def up() -> bool:
        try:
            anonymous.ping()
        except redis.AuthenticationError:
            return True
        except redis.ConnectionError:
            return False
        return True

    wait_for(up, timeout=15)
    yield port, password, folder
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(folder, ignore_errors=True)


def test_the_shipped_redis_refuses_anyone_without_the_password(shipped_redis) -> None:
    import redis

    port, password, folder = shipped_redis
    with pytest.raises(redis.AuthenticationError):  # the default user is off: not even PING
        redis.Redis(port=port, socket_timeout=5).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, username="tooloop", password="wrong", socket_timeout=5).ping()
    ours = redis.Redis.from_url(f"redis://tooloop:{password}@127.0.0.1:{port}/0", socket_timeout=5)
    assert ours.ping()
    for command in (("FLUSHALL",), ("CONFIG", "GET", "dir"), ("SHUTDOWN",), ("ACL", "LIST")):
        with pytest.raises(redis.exceptions.NoPermissionError):  # the server's own commands are refused
            ours.execute_command(*command)
    assert ours.ping()  # and it still runs
    assert (folder / "users.acl").stat().st_mode & 0o077 == 0  # the password file is private
    assert password not in " ".join(subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True,
                                                   text=True).stdout.split())  # fmt: skip


def test_a_run_goes_through_the_shipped_redis_with_the_password(shipped_redis, deployment, spec) -> None:
    port, password, _ = shipped_redis
    url = f"redis://tooloop:{password}@127.0.0.1:{port}/0"
    d = deployment(TOOLOOP_REDIS_URL=url)
    d.start_worker()
    result = d.client.submit(spec([{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]},
                                   {"content": "3"}], tools=["add"])).wait(timeout=60)  # fmt: skip
    assert (result.status, result.tool_calls[0].output) == ("completed", 3)


def test_flower_answers_only_with_its_basic_auth(tmp_path) -> None:
    port = free_port()
    log = (tmp_path / "flower.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "flower", f"--port={port}",
                             "--address=127.0.0.1"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "FLOWER_BASIC_AUTH": "ops:s3cret"})  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            try:
                return httpx.get(base + "/", timeout=5).status_code > 0
            except httpx.TransportError:
                assert proc.poll() is None, (tmp_path / "flower.log").read_text()
                return False

        wait_for(up, timeout=READY_S, interval=0.3)
        # every page and API call; Flower's own /metrics and /healthcheck (counts only) stay open
        for path in ("/", "/workers", "/tasks", "/api/workers", "/api/tasks", "/api/queues/length"):
            assert httpx.get(base + path, timeout=10).status_code == 401, path
            assert httpx.get(base + path, auth=("ops", "wrong"), timeout=10).status_code == 401, path
        assert httpx.get(base + "/api/workers", auth=("ops", "s3cret"), timeout=30).status_code == 200
    finally:
        proc.terminate()
        proc.wait(20)
    assert "without authentication" not in (tmp_path / "flower.log").read_text()


def test_flower_without_auth_says_so() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWER_")}
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "flower", "--port=not-a-port"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "warning: Flower runs without authentication" in done.stderr


# -- the probes the manifests ship, against real workers -----------------------------------------
def _probe(deployment_name: str, kind: str) -> dict[str, Any]:
    container = pod(objects(kustomize(K8S), "Deployment")[deployment_name])["containers"][0]
    return container[kind]


def _run_probe(command: list[str], hostname: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The exec probe as the kubelet runs it in the pod: HOSTNAME is the pod's (the worker's node
    name), `celery` on PATH."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return subprocess.run(command, env={**os.environ, **env, "HOSTNAME": hostname, "PATH": path}, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_the_liveness_probe_answers_for_a_live_pool_and_fails_for_a_hung_one(deployment) -> None:
    d = deployment()
    proc = d.start_worker("-Q", "tools", "-c", "1", roles=("tools",))
    probe = _probe("tooloop-tools", "livenessProbe")
    turns_probe = _probe("tooloop-turns", "livenessProbe")
    assert turns_probe["exec"]["command"][-1] == probe["exec"]["command"][-1].replace("tools@", "turns@")
    alive = _run_probe(probe["exec"]["command"], proc.name, d.env)
    assert alive.returncode == 0, alive.stdout + alive.stderr
    assert f"tools@{proc.name}: OK" in alive.stdout
    # a pool that hangs (its process alive, answering nothing) fails the probe within its timeout
    # the Celery worker's main process: the launcher's child (its pool children are its own)
    found = subprocess.run(["pgrep", "-P", str(proc.proc.pid), "-f", f"tools@{proc.name}"],
                           capture_output=True, text=True)  # fmt: skip
    main, = (int(pid) for pid in found.stdout.split())
    os.kill(main, signal.SIGSTOP)
    try:
        hung = _run_probe(probe["exec"]["command"], proc.name, d.env)
    finally:
        os.kill(main, signal.SIGCONT)
    assert hung.returncode != 0 and f"tools@{proc.name}: OK" not in hung.stdout


def test_the_readiness_probe_fails_while_redis_is_away_and_recovers(tmp_path) -> None:
    """/healthz (the readinessProbe) asks Redis: a pod whose Redis is gone leaves the Service."""
    from tests.conftest import Deployment

    port = free_port()
    redis_proc = start_redis(port)
    d = Deployment(f"ready-{os.getpid()}", {"TOOLOOP_REDIS_URL": f"redis://127.0.0.1:{port}/0"})
    metrics_port = free_port()
    try:
        d.start_worker("-Q", "tools", "-c", "1", "--metrics-port", str(metrics_port), roles=("tools",))
        probe = _probe("tooloop-tools", "readinessProbe")["httpGet"]
        url = f"http://127.0.0.1:{metrics_port}{probe['path']}"

        def answer() -> tuple[int, str]:
            try:
                reply = httpx.get(url, timeout=10)
            except httpx.TransportError as exc:
                return 0, repr(exc)
            return reply.status_code, reply.text

        assert wait_for(lambda: answer()[0] == 200, timeout=60)
        redis_proc.terminate()
        redis_proc.wait(10)
        code, text = wait_for(lambda: (a := answer())[0] != 200 and a, timeout=30)
        assert code == 503 and ("Redis unreachable" in text or "not running" in text), text
        redis_proc = start_redis(port)  # back, empty: the pool reconnects and registers again
        assert wait_for(lambda: answer()[0] == 200, timeout=90)
    finally:
        d.stop()
        redis_proc.terminate()
        redis_proc.wait(10)


# -- a tool worker never loads litellm ------------------------------------------------------------
IMPORT_WATCH = """
import os, sys

class _Watch:
    \"\"\"Notes every import of the model stack by any process started with this folder on its path.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name in ("litellm", "openai"):
            try:
                with open(os.environ["TOOLOOP_TEST_IMPORT_LOG"], "a") as log:
                    log.write(f"{os.getpid()} {name} {' '.join(sys.argv)[:160]}\\n")
            except OSError:
                pass
        return None

sys.meta_path.insert(0, _Watch())
"""


def test_a_tool_worker_never_imports_litellm(deployment, spec, tmp_path) -> None:
    """Every process of `tooloop worker -Q tools` (launcher, Celery worker, pool children, tool
    calls) runs whole runs' tool calls without importing litellm or openai: its pod's memory
    request holds (docs/bench/worker_rss.txt). The turn worker, watched the same way, does
    import them: the watch works."""
    watch = tmp_path / "watch"
    watch.mkdir()
    (watch / "sitecustomize.py").write_text(IMPORT_WATCH)
    path = os.pathsep.join([str(watch), os.environ["PYTHONPATH"]])
    logs = {role: tmp_path / f"{role}.imports" for role in ("turns", "tools")}
    d = deployment()
    for role, log in logs.items():
        d.start_worker("-Q", role, roles=(role,),
                       env={"PYTHONPATH": path, "TOOLOOP_TEST_IMPORT_LOG": str(log)})  # fmt: skip
    steps = [tools(call("modules"), call("add", {"a": 1, "b": 2}), call("write_file", {"path": "a.txt",
                                                                                         "content": "x"}),
                   call("shell", {"command": "ls"})), {"content": "done"}]  # fmt: skip
    result = d.client.submit(spec(steps, tools=["modules", "add", "write_file", "shell"])).wait(timeout=90)
    assert result.status == "completed"
    assert all(c.success for c in result.tool_calls), [c.error for c in result.tool_calls]
    assert result.tool_calls[0].output == []  # the tool call's own process
    assert "litellm" in logs["turns"].read_text()
    assert not logs["tools"].exists(), logs["tools"].read_text()
