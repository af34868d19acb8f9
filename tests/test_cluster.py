"""Redis Cluster as the run store, for real: six redis-server processes in cluster mode
(three primaries, one replica each) started by the test (tests/servers.py).

The broker cannot be the cluster (kombu's Redis transport has no Cluster support): it is
the session's plain Redis or RabbitMQ. Runs complete on it; every Lua script touches keys
of one hash slot, seen from inside Redis (MONITOR); a primary killed mid-run is replaced
by its replica and every run completes, billed once, each effect once.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.crc import key_slot

from orchestrator import Status
from orchestrator.connections import ACL_COMMANDS, CLUSTER_ACL_COMMANDS
from tests.helpers import assert_done, call, gate, tool_run, tools, wait_for

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
    reason="redis-server and redis-cli are needed to start a Redis Cluster",
)


@pytest.fixture(scope="module")
def cluster() -> Iterator:
    from tests.servers import RedisCluster

    group = RedisCluster(masters=3, replicas=1)
    yield group
    group.stop()


@pytest.fixture(params=["redis", "amqp"])
def broker(request) -> str:
    """The broker beside the cluster store: the session's plain Redis, or RabbitMQ."""
    if request.param == "amqp":
        return request.getfixturevalue("amqp_url")
    return os.environ["TOOLOOP_REDIS_URL"]


def node_of(cluster_client, key: str) -> str:
    return cluster_client.get_node_from_key(key).name


def test_runs_complete_on_cluster(deployment, spec, cluster, broker):
    from redis.cluster import RedisCluster

    # under fair share (a cap of 3 runs: 5 wait in their tenant's queue, under its own hash tag)
    d = deployment(TOOLOOP_REDIS_URL=cluster.url, TOOLOOP_BROKER_URL=broker, TOOLOOP_TENANT_MAX_ACTIVE="*=3")
    assert isinstance(d.store.redis, RedisCluster)  # detected from the server, no setting
    d.start_worker("-c", "2")
    handles = [d.client.submit(tool_run(spec)) for _ in range(8)]
    assert sum(h.result().status_reason == "waiting_share" for h in handles) == 5
    for handle in handles:
        assert_done(handle.wait(timeout=90))
    wait_for(lambda: not d.store.redis.hlen(d.store.keys.fair_runs()), timeout=15)  # every slot given back
    # the runs really are spread over the primaries, and listing merges every shard
    nodes = {node_of(d.store.redis, d.store.keys.run(h.run_id)) for h in handles}
    assert len(nodes) >= 2, nodes
    assert {r["run_id"] for r in d.client.list(limit=20)} >= {h.run_id for h in handles}
    # the sweeper's batch look works on a Cluster (redis-py refuses EVALSHA in its pipelines)
    looks = d.store.recover_many([h.run_id for h in handles])
    assert [getattr(r, "outcome", r) for r in looks] == ["ended"] * len(handles)
    assert "maintenance step" not in d.workers[0].tail(100_000), d.workers[0].tail()


def test_rate_limits_and_api_events_through_a_node_without_their_slot(deployment, spec, cluster):
    """The URL names a primary that serves neither the rate-limit buckets' slot nor a
    run's: the rate limiter's and the API's asyncio clients are cluster clients too."""
    import json

    from fastapi.testclient import TestClient

    from orchestrator.api import create_app
    from orchestrator.keys import Keys

    probe = deployment(TOOLOOP_REDIS_URL=cluster.url)
    bucket_node = node_of(probe.store.redis, Keys("x").rate_bucket("any"))
    other = next(p for p in cluster.masters() if f"127.0.0.1:{p}" != bucket_node)
    url = f"redis://127.0.0.1:{other}/0"
    limits = {"models": {"*": {"rpm": 6000, "burst": 50}}}
    d = deployment(TOOLOOP_REDIS_URL=url, TOOLOOP_BROKER_URL=os.environ["TOOLOOP_REDIS_URL"],
                   TOOLOOP_RATE_LIMITS=json.dumps(limits))  # fmt: skip
    d.start_worker("-c", "2")
    here = f"127.0.0.1:{other}"
    handles = [d.client.submit(dict(tool_run(spec), tenant="acme")) for _ in range(4)]
    while all(node_of(d.store.redis, d.store.keys.events(h.run_id)) == here for h in handles):
        handles.append(d.client.submit(dict(tool_run(spec), tenant="acme")))  # a run's slot is random
    for handle in handles:
        assert_done(handle.wait(timeout=60))
    buckets = list(d.store.redis.scan_iter(f"{d.store.keys.prefix}:{{ratelimit}}:*"))
    assert buckets and all(node_of(d.store.redis, k.decode()) != here for k in buckets)  # taken from
    elsewhere = next(h for h in handles if node_of(d.store.redis, d.store.keys.events(h.run_id)) != here)
    app = create_app(d.settings.model_copy(update={"api_tokens": "tok=acme"}), client=d.client)
    with TestClient(app) as http:
        reply = http.get(f"/api/runs/{elsewhere.run_id}/events", headers={"Authorization": "Bearer tok"})
    assert reply.status_code == 200, reply.text
    assert "event: outcome" in reply.text


# -- every script on one slot, seen from inside Redis ---------------------------------
QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
LINE = re.compile(r"^\d+\.\d+ \[\d+ ([^\]]+)\] (.*)$")
CONTAINERS = {"cluster", "script", "command", "client", "config", "acl", "object", "xinfo", "memory"}


class Monitor:
    """``redis-cli MONITOR`` on each primary, into a file. Redis logs an EVALSHA before
    the commands its script runs (``[0 lua]``), one command at a time: the lines after a
    script's call, up to the next client's command, are that script's."""

    def __init__(self, ports: list[int], folder: Path) -> None:
        self.files = [folder / f"monitor-{port}.txt" for port in ports]
        self.procs = [
            subprocess.Popen(["redis-cli", "-p", str(port), "monitor"], stdout=f.open("w"))
            for port, f in zip(ports, self.files, strict=True)
        ]

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()

    def client_commands(self, nodes: list[int]) -> set[str]:
        """Commands clients sent (not scripts, not a primary's replication stream, which
        comes from another node's address), named as ACL rules name them (``cluster|slots``)."""
        names = set()
        for file in self.files:
            for line in file.read_text(errors="replace").splitlines():
                match = LINE.match(line)
                who = match.group(1) if match else "lua"
                if who == "lua" or int(who.rsplit(":", 1)[1]) in nodes:
                    continue
                args = QUOTED.findall(match.group(2))
                if args:
                    name = args[0].lower()
                    names.add(f"{name}|{args[1].lower()}" if name in CONTAINERS and len(args) > 1 else name)
        return names

    def scripts(self) -> Iterator[tuple[str, list[str], list[list[str]]]]:
        """(sha, declared keys, commands the script ran) for each script call seen."""
        for file in self.files:
            current = None
            for line in file.read_text(errors="replace").splitlines():
                match = LINE.match(line)
                if not match:
                    continue
                who, args = match.group(1), [a.replace('\\"', '"') for a in QUOTED.findall(match.group(2))]
                if who == "lua" and current is not None:
                    current[2].append(args)
                    continue
                if current is not None:
                    yield current
                    current = None
                if args and args[0].lower() in ("evalsha", "eval"):
                    numkeys = int(args[2])
                    current = (args[1], args[3 : 3 + numkeys], [])
            if current is not None:
                yield current


def command_keys(spec: dict, args: list[str]) -> list[str]:
    first, last, step = spec["first_key_pos"], spec["last_key_pos"], spec["step_count"]
    if first == 0:
        return []
    last = len(args) + last if last < 0 else last
    return args[first : last + 1 : step]


def script_names() -> dict[str, str]:
    """sha1 -> name of every script tooloop loads."""
    return {hashlib.sha1(text.encode()).hexdigest(): name for name, text in script_sources().items()}


def test_every_script_touches_one_slot(deployment, spec, cluster, holds, tmp_path, model_server):
    """A workload through every kind of script (tool calls, pause, steer, resume, abort,
    an approval, a rate limit, the sweeper, child runs), watched with MONITOR on each
    primary: each script call names keys of one slot and runs commands on those keys
    only, or on the keys of a run of its tree (a child run lives in its parent's shard:
    ``key_of`` in scripts.PRELUDE); every command the clients send is one an ACL user
    is given (ACL_COMMANDS and, for a cluster, CLUSTER_ACL_COMMANDS)."""
    import json

    import redis

    limits = {"models": {"*": {"rpm": 6000, "burst": 50}}}  # the rate-limit scripts run too
    monitor = Monitor(cluster.masters(), tmp_path)
    try:
        d = deployment(TOOLOOP_REDIS_URL=cluster.url, TOOLOOP_BROKER_URL=os.environ["TOOLOOP_REDIS_URL"],
                       TOOLOOP_RATE_LIMITS=json.dumps(limits),  # fair share's scripts run too, none waits
                       TOOLOOP_TENANT_MAX_ACTIVE="*=100")  # fmt: skip
        d.start_worker("-c", "2")
        plain = [d.client.submit(tool_run(spec, delay=0.3)) for _ in range(3)]
        controlled = plain[0]
        wait_for(lambda: d.store.result(controlled.run_id).iterations >= 1, timeout=30)
        assert controlled.pause() == "ok" and controlled.steer("keep going") == "ok"
        assert d.client.resume(controlled.run_id) == "ok"
        gated = d.client.submit(spec([tools(call("guarded_append", {"text": "x"}, call_id="call_g")),
                                      {"content": "done"}], tools=["guarded_append"]))  # fmt: skip
        wait_for(lambda: gated.pending_approvals(), timeout=30)
        assert gated.approve("call_g") == "ok"
        held = d.client.submit(spec([{"content": "never", "hold": gate(holds)}]))
        wait_for(lambda: held.status() == Status.running, timeout=30)
        assert held.abort() == "ok"
        kid = {"model": model_server.script([tools(call("add", {"a": 1, "b": 1})), {"content": "2"}]),
               "model_params": {"api_base": model_server.api_base}, "tools": ["add"]}  # fmt: skip
        twice = tools(call("agent__kid", {"prompt": "1+1"}), call("agent__kid", {"prompt": "1+1"}))
        tree = d.client.submit(spec([twice, {"content": "done"}], token_budget=1000, agents={"kid": kid}))
        child_held = gate(holds)
        doomed = d.client.submit(spec([tools(call("agent__slow", {"prompt": "wait"})), {"content": "never"}],
                                      agents={"slow": {**kid, "model": model_server.script(
                                          [{"content": "late", "hold": child_held}])}}))  # fmt: skip
        wait_for(lambda: doomed.result().children, timeout=30)
        assert doomed.abort() == "ok"  # its child is aborted in the same script
        child_held.set()
        for handle in plain:
            assert_done(handle.wait(timeout=60))
        assert gated.wait(timeout=60).status == Status.completed
        done = tree.wait(timeout=60)
        assert done.status == Status.completed and [r.output for r in done.tool_calls] == ["2", "2"]
        assert done.tokens_used == 2 * 30 + 2 * 60  # the children's spend counted in, on the cluster
    finally:
        monitor.stop()
    specs = {name.lower(): info for name, info in redis.Redis(port=cluster.masters()[0]).command().items()}
    names, seen, tree = script_names(), set(), 0
    for sha, declared, commands in monitor.scripts():
        name = names.get(sha, sha)
        touched = [k for args in commands for k in command_keys(specs[args[0].lower()], args)]
        slots = {key_slot(k.encode()) for k in declared + touched}
        assert len(slots) == 1, f"{name} spans slots {sorted(slots)}: {declared} {touched}"
        undeclared = set(touched) - set(declared)
        assert all(RUN_KEY.fullmatch(k) and k.split(":run:")[0] == declared[0].split(":run:")[0]
                   for k in undeclared), f"{name} touches undeclared keys {undeclared}"  # fmt: skip
        tree += bool(undeclared)
        seen.add(name)
    assert tree, "no script reached a run of its tree (a parent's keys from its child's)"
    wanted = {"CREATE", "CLAIM_TURN", "RECORD_REPLY", "START_CALL", "RECORD_CALL", "PAUSE", "RESUME",
              "STEER", "ABORT", "DUE", "PARK", "DECIDE", "TAKE", "START_CHILD", "STAGE",
              "FAIR_ENQUEUE", "FAIR_PUMP", "OPEN_GATE"}  # fmt: skip
    assert wanted <= seen, f"not exercised: {wanted - seen} (seen: {sorted(seen)})"
    sent = monitor.client_commands(cluster.ports)
    allowed = set(ACL_COMMANDS) | set(CLUSTER_ACL_COMMANDS)
    assert "evalsha" in sent and sent <= allowed, f"not in the ACL lists: {sorted(sent - allowed)}"


RUN_KEY = re.compile(r"[^{}]+:\{s\d+\}:run:[A-Za-z0-9_-]{1,64}:[a-z]+")  # keys.Keys._run


def script_sources() -> dict[str, str]:
    from orchestrator import approvals, children, fairshare, fork, journal, scripts, telemetry
    from worker import ratelimit

    sources = {name: scripts.PRELUDE + getattr(scripts, name) for name in scripts.RUN_SCRIPTS}
    return sources | {"DUE": scripts.DUE, "QUEUED": scripts.QUEUED, "JUMP": scripts.JUMP,
                      "PARK": approvals.PARK, "DECIDE": approvals.DECIDE, "MARK_END": telemetry.MARK_END,
                      "TAKE": ratelimit.TAKE, "SETTLE": ratelimit.SETTLE, "STAGE": journal.STAGE,
                      "FORK_READ": fork.READ, "FORK_WRITE": fork.WRITE,
                      "START_CHILD": scripts.PRELUDE + children.START_CHILD,
                      "FAIR_ENQUEUE": fairshare.ENQUEUE, "FAIR_PUMP": fairshare.PUMP}  # fmt: skip


def test_scripts_name_keys_only_through_KEYS():
    """The scripts MONITOR did not see run are read instead: every command's key is
    ``KEYS[...]`` or a local bound to it, never a name built inside Lua (which Cluster
    cannot route, and which might hash to another slot). The one exception: the keys of
    another run of the tree, ``key_of(id, i)`` (KEYS[i] with that run's id in place of the
    script's own), in the same shard by construction (orchestrator/children.py)."""
    calls = re.compile(r"redis\.p?call\(\s*'(\w+)'\s*(?:,\s*([^,)]+(?:\([^)]*\))?))?")
    for name, source in script_sources().items():
        bound, derived = set(), set()
        local = r"local ([A-Za-z_][A-Za-z_, ]*) =\s*([^\n]*(?:\n\s+KEYS[^\n]*)?)"
        for names, values in re.findall(local, source):
            if "KEYS[" in values:
                bound |= {n.strip() for n in names.split(",") if n.strip().isupper()}
            if values.startswith("key_of("):  # `local pk, ck = key_of(parent, 1), key_of(parent, 4)`
                derived |= {n.strip() for n in names.split(",")}
        for command, first in calls.findall(source):
            first = first.strip()
            if command in ("TIME",):
                continue
            ok = first.startswith(("KEYS[", "key_of(")) or first in bound or first in derived
            assert ok, f"{name}: {command} {first} is not from KEYS"


def test_every_scripts_keys_share_one_slot():
    """What the store passes as KEYS: a run's keys, its shard's indexes and the tenant
    index hash to one slot, for any run id and tenant."""
    import uuid

    from orchestrator.keys import SHARDS, Keys, shard_of

    keys = Keys("tooloop")
    for i in range(500):
        run_id, tenant = uuid.uuid4().hex, f"tenant-{i % 7}"
        named = [*keys.script_keys(run_id), keys.tenant_runs(tenant, shard_of(run_id))]
        assert len({key_slot(k.encode()) for k in named}) == 1, named
    for shard in range(SHARDS):
        assert key_slot(keys.sweep_lock(shard).encode()) == key_slot(keys.leases(shard).encode())
    # a child run's keys (and its children's) hash to its parent's slot: scripts reach them
    from orchestrator.children import child_id

    for i in range(200):
        parent = uuid.uuid4().hex
        grandchild = child_id(child_id(parent, f"{i}.0"), "1.2")
        assert key_slot(keys.run(grandchild).encode()) == key_slot(keys.run(parent).encode())


# -- failover ---------------------------------------------------------------------------
def effects(run_id: str) -> list[str]:
    path = Path(os.environ["TOOLOOP_SANDBOX_ROOT"], run_id, "effects.txt")
    return path.read_text().splitlines() if path.exists() else []


def test_cluster_primary_fails_over_mid_run(deployment, spec, cluster):
    """A primary holding some of the runs is killed mid-run; the cluster promotes its
    replica; every run completes, each reply billed once, each effect run once."""
    d = deployment(TOOLOOP_REDIS_URL=cluster.url, TOOLOOP_BROKER_URL=os.environ["TOOLOOP_REDIS_URL"])
    d.start_worker("-c", "4")
    turns = 4
    handles = []
    for i in range(12):
        steps = [tools(call("append_then_sleep", {"text": f"r{i}-t{t}", "seconds": 0.3}))
                 for t in range(turns)]  # fmt: skip
        handles.append(d.client.submit(spec([*steps, {"content": "done"}], tools=["append_then_sleep"])))
    url_port = int(cluster.url.rsplit(":", 1)[1].split("/")[0])
    victim = next(p for p in cluster.masters() if p != url_port)  # new clients still find the cluster
    served = {h.run_id: node_of(d.store.redis, d.store.keys.run(h.run_id)) for h in handles}
    on_victim = [h for h in handles if served[h.run_id] == f"127.0.0.1:{victim}"]
    assert on_victim, "no run lives on the primary to be killed"
    wait_for(lambda: all(d.store.result(h.run_id).iterations >= 1 for h in on_victim), timeout=60)
    cluster.kill(victim)
    cluster.wait_failover(victim, timeout=60)  # its replica is promoted: all slots served again
    for i, handle in enumerate(handles):
        try:
            result = handle.wait(timeout=120)
        except Exception:
            raise AssertionError(f"run {i} unfinished after the failover:\n{d.workers[0].tail()}") from None
        assert (result.status, result.content) == (Status.completed, "done"), d.workers[0].tail()
        assert result.tokens_used == 30 * result.iterations  # each reply billed once
        assert len(result.tool_calls) == turns
        # Each effect at most once. A write the killed primary acknowledged but had not yet
        # passed to its replica is lost with it (Redis replicates asynchronously): a call whose
        # claim was lost so may be recorded as lost, its outcome unknown, without running again.
        done, records = effects(handle.run_id), {r.iteration: r for r in result.tool_calls}
        assert len(done) == len(set(done)) and set(done) <= {f"r{i}-t{t}" for t in range(turns)}, done
        for t in range(turns):
            record = records[t + 1]
            assert f"r{i}-t{t}" in done or (not record.success and "WorkerLost" in (record.error or "")), (
                i, t, done, record)


def test_a_forked_call_forgets_the_cluster_clients_password(cluster):
    """The fork layer's child drops the store client's credentials (worker/sandbox/forget.py):
    on a cluster client they sit in the nodes manager and in every node's pool and connection."""
    from orchestrator.connections import connect, forget_credentials
    from tests.hostile_tools import _shown

    password = f"hunter2-{uuid.uuid4().hex[:6]}"  # the default user is nopass: any password works
    client = connect(cluster.url.replace("redis://", f"redis://default:{password}@"))
    client.ping()  # every node's pool holds a connection now

    def held() -> str:
        nodes = client.nodes_manager.nodes_cache.values()
        objects = [client.nodes_manager, *(n.redis_connection.connection_pool for n in nodes)]
        objects += [c for n in nodes for c in n.redis_connection.connection_pool._available_connections]
        return "\n".join(_shown(o) for o in objects)

    assert password in held()  # the control: the hunt finds it before
    forget_credentials(client)
    assert password not in held()
