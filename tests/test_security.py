"""Trust boundaries: no submitter reaches past its own (credentials, run ids, tool payloads, ...).

The witness for the credential holes is an attacker's HTTP server on loopback that
records every request it gets: it must never see the worker's secrets. A "hostile
producer" writes its spec straight into the store (anyone with Redis access can),
skipping the producer's checks: the worker must refuse on its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from orchestrator import SpecError, Status
from orchestrator.client import RunHandle
from orchestrator.models import RunSpec
from tests.conftest import ROOT
from tests.helpers import call, tools

WORKER_SECRETS = ("test-secret", "sk-test")  # TOOLOOP_SECRET_KEY, OPENAI_API_KEY of every test worker


# -- the attacker's server ------------------------------------------------------------
class Attacker:
    """Records the headers and body of every request; answers like a chat model would."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        attacker = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                attacker.seen.append({"path": self.path, "headers": headers, "body": body.decode()})
                reply = json.dumps({
                    "id": "x", "object": "chat.completion", "created": 0, "model": "m",
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": "thanks for the key"}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }).encode()  # fmt: skip
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def api_base(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def leaked(self, *secrets: str) -> list[str]:
        text = json.dumps(self.seen)
        return [s for s in secrets if s in text]


@pytest.fixture
def attacker() -> Iterator[Attacker]:
    server = Attacker()
    yield server
    server.server.shutdown()
    server.server.server_close()


def hostile_submit(client, spec: dict[str, Any], run_id: str | None = None) -> RunHandle:
    """What a producer with Redis access can do without any check: write the run, enqueue it."""
    from orchestrator.prompt import initial_messages
    from worker.app import enqueue_turn

    parsed = RunSpec.model_validate(spec)
    run_id = run_id or uuid.uuid4().hex
    gen = client.store.create(run_id, parsed, initial_messages(parsed))
    enqueue_turn(run_id, 1, gen, client.celery)
    return RunHandle(client, run_id)


def footprint(store) -> tuple[int, int]:
    keys = sum(1 for _ in store.redis.scan_iter(f"{store.keys.prefix}:run:*", count=1000))
    queued = store.redis.llen(store.keys.broker_prefix + store.keys.turn_queue)
    return keys, queued


def stolen(attacker: Attacker) -> list[dict[str, Any]]:
    """Each hostile spec: (params, the field the refusal names)."""
    base = attacker.api_base
    return [
        ({"api_key_env": "TOOLOOP_SECRET_KEY", "api_base": base}, "model_params.api_key_env"),
        ({"api_key_env": "OPENAI_API_KEY", "api_base": base}, "model_params.api_base"),
        ({"api_base": base}, "model_params.api_base"),  # litellm reads OPENAI_API_KEY by itself
        ({"base_url": base}, "model_params.base_url"),
        ({"api_key": "os.environ/TOOLOOP_SECRET_KEY", "api_base": base}, "model_params.api_key"),
    ]


HOSTILE = range(5)  # indexes into stolen(): parametrize needs them before the fixture exists


# -- hole 1: the worker's environment ----------------------------------------------------
@pytest.mark.parametrize("case", HOSTILE)
def test_spec_reaching_for_worker_keys_is_refused_at_submit(client, store, attacker, case):
    params, field = stolen(attacker)[case]
    before = footprint(store)
    with pytest.raises(SpecError) as refused:
        client.submit({"prompt": "x", "model": "openai/gpt-4o-mini", "model_params": params})
    assert field in str(refused.value)
    assert footprint(store) == before


@pytest.mark.parametrize("case", HOSTILE)
def test_worker_refuses_hostile_params_before_any_request(client, worker, attacker, case):
    """Failed before the fix: the attacker received `Bearer test-secret` / `Bearer sk-test`."""
    params, field = stolen(attacker)[case]
    handle = hostile_submit(client, {"prompt": "x", "model": "openai/m", "model_params": params})
    result = handle.wait(timeout=60)
    assert (result.status, result.exit) == (Status.failed, "error")
    assert result.error_type == "RefusedParams" and field in result.error, result.error
    assert attacker.seen == [], attacker.leaked(*WORKER_SECRETS)


def test_judge_params_follow_the_same_rules(client, worker, spec, attacker, model_server):
    params = {"api_key_env": "TOOLOOP_SECRET_KEY", "api_base": attacker.api_base}
    judge = {"model": "openai/judge", "on_judge_error": "abort", "model_params": params}
    s = spec([tools(call("add", {"a": 1, "b": 1})), {"content": "done"}], tools=["add"],
             supervisor={"judge": judge})  # fmt: skip
    with pytest.raises(SpecError) as refused:
        client.submit(s)
    assert "supervisor.judge.model_params.api_key_env" in str(refused.value)
    # Straight into Redis: the judge call is refused in the worker, and the policy applies.
    result = hostile_submit(client, s).wait(timeout=60)
    assert result.status == Status.aborted and "RefusedParams" in result.error, result.error
    assert attacker.seen == [], attacker.leaked(*WORKER_SECRETS)


def test_sealed_key_opens_only_for_its_tenant(client, worker, spec, store, attacker):
    """Failed before the fix: acme's sealed blob, copied into globex's spec with globex's
    api_base, was opened by the worker and sent to the attacker in clear."""
    own = client.submit(spec([{"content": "ok"}], tenant="acme", model_params={"api_key": "sk-acme-own"}))
    assert own.wait(timeout=60).status == Status.completed
    blob = json.loads(store.redis.hget(store.keys.run(own.run_id), "spec"))["model_params"]["api_key"]
    assert blob.startswith("sealed:") and "sk-acme-own" not in blob
    stolen_spec = {"prompt": "x", "model": "openai/m", "tenant": "globex",
                   "model_params": {"api_key": blob, "api_base": attacker.api_base}}  # fmt: skip
    with pytest.raises(SpecError) as refused:
        client.submit(stolen_spec)
    assert "model_params.api_key" in str(refused.value) and "globex" in str(refused.value)
    result = hostile_submit(client, stolen_spec).wait(timeout=60)
    assert (result.exit, result.error_type) == ("error", "SecretError"), result.error
    assert attacker.seen == [] and not attacker.leaked("sk-acme-own")


def test_every_credential_is_sealed_at_rest_and_reaches_the_model(client, worker, store, attacker):
    """Headers and other credential-bearing params are sealed too; the worker opens them.
    (The spec brings its own key, so it may name its own endpoint.)"""
    params = {"api_key": "sk-own-1", "api_base": attacker.api_base,
              "extra_headers": {"X-Api-Key": "hdr-secret-2", "X-Trace": "trace-3"}}  # fmt: skip
    handle = client.submit({"prompt": "x", "model": "openai/m", "model_params": params})
    assert handle.wait(timeout=60).status == Status.completed
    raw = store.redis.hget(store.keys.run(handle.run_id), "spec").decode()
    assert not [s for s in ("sk-own-1", "hdr-secret-2", "trace-3") if s in raw], raw
    [request] = attacker.seen
    assert request["headers"]["authorization"] == "Bearer sk-own-1"
    assert (request["headers"]["x-api-key"], request["headers"]["x-trace"]) == ("hdr-secret-2", "trace-3")


def test_cli_submit_refuses_with_exit_2_naming_the_field(store, tmp_path, attacker):
    path = tmp_path / "steal.yaml"
    path.write_text(f"prompt: x\nmodel: openai/m\nmodel_params:\n  api_key_env: TOOLOOP_SECRET_KEY\n"
                    f"  api_base: {attacker.api_base}\n")  # fmt: skip
    before = footprint(store)
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env=os.environ)  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "model_params.api_key_env" in out.stderr and out.stdout == ""
    assert footprint(store) == before


# -- the rules, unit by unit ------------------------------------------------------------------
@pytest.mark.parametrize(
    "url, allowed",
    [
        ("https://api.example.com", True),
        ("https://api.example.com/v1/chat", True),
        ("https://API.example.com:443/", True),
        ("https://api.example.com.evil.net", False),
        ("https://api.example.com@evil.net", False),
        ("https://evil.net#@api.example.com", False),
        ("https://evil.net/?@api.example.com", False),
        ("http://api.example.com", False),
        ("https://api.example.com:8443", False),
        ("http://127.0.0.1:8000/v1", True),
        ("http://127.0.0.1:8000/v1/", True),
        ("http://127.0.0.1:8000/v10", False),
        ("http://127.0.0.1:8000/", False),
        ("http://127.0.0.1:8000/v1/../admin", False),
        ("http://127.0.0.1:8000/v1/%2e%2e/admin", False),
        ("http://127.0.0.1:8000\\@evil.net/v1", False),
        ("file:///etc/passwd", False),
        (None, False),
    ],
)
def test_api_base_prefixes_match_safely(url, allowed):
    from orchestrator.credentials import base_allowed

    assert base_allowed(url, ["https://api.example.com", "http://127.0.0.1:8000/v1"]) is allowed


@pytest.mark.parametrize(
    "name, setting, allowed",
    [
        ("OPENAI_API_KEY", "*_API_KEY", True),
        ("HOME", "*_API_KEY", False),
        ("TOOLOOP_SECRET_KEY", "*", False),
        ("TOOLOOP_DEMO_API_KEY", "*_API_KEY", False),
        ("tooloop_secret_key", "*", False),
        ("MY_TOKEN", "OPENAI_API_KEY, MY_*", True),
        ("", "*", False),
    ],
)
def test_key_env_allowlist(name, setting, allowed):
    from orchestrator.credentials import key_env_allowed, key_env_patterns

    assert key_env_allowed(name, key_env_patterns(setting)) is allowed


@pytest.mark.parametrize(
    "params, named",
    [
        ({"aws_web_identity_token": "TOOLOOP_SECRET_KEY"}, "aws_web_identity_token"),
        ({"aws_profile_name": "prod"}, "aws_profile_name"),
        ({"vertex_credentials": "/var/run/gcp.json"}, "vertex_credentials"),
        ({"ssl_verify": "/etc/ssl/ca.pem"}, "ssl_verify"),
        ({"ssl_verify": False}, "ssl_verify"),
        ({"callbacks": ["langfuse"]}, "callbacks"),
        ({"langfuse_host": "https://evil.net"}, "langfuse_host"),
        ({"metadata": {"langfuse_host": "https://evil.net"}}, "metadata.langfuse_host"),
        ({"aws_bedrock_runtime_endpoint": "https://evil.net"}, "aws_bedrock_runtime_endpoint"),
        ({"vertex_location": "evil.net/x#"}, "vertex_location"),
        ({"extra_headers": {"X": "os.environ/AWS_SECRET_ACCESS_KEY"}}, "extra_headers.X"),
        ({"api_key": "sk", "api_key_env": "OPENAI_API_KEY"}, "not both"),
    ],
)
def test_params_that_reach_into_the_worker_are_refused(params, named):
    from orchestrator.credentials import check_params
    from orchestrator.settings import Settings

    errors = check_params(params, Settings(allowed_api_bases="https://api.example.com"))
    assert errors and named in " ".join(errors), errors


def test_own_key_may_go_to_its_own_endpoint_side_channels_may_not():
    from orchestrator.credentials import check_call
    from orchestrator.settings import Settings

    settings = Settings(allowed_api_bases="")
    assert check_call("openai/m", {"api_key": "sk", "api_base": "https://mine.example"}, settings) == []
    assert check_call("openai/m", {"api_key_env": "OPENAI_API_KEY", "temperature": 0}, settings) == []
    errors = check_call("openai/m", {"api_key": "sk", "langfuse_host": "https://x.example"}, settings)
    assert "langfuse_host" in errors[0]
    assert "model:" in check_call("huggingface/https://evil.example/x", {}, settings)[0]


def test_sealing_is_bound_to_the_tenant():
    from orchestrator.secrets import SecretError, seal, unseal

    blob = seal({"k": "v"}, "acme", secret="s1")
    assert unseal(blob, "acme", secret="s1") == {"k": "v"}
    for tenant, secret in (("globex", "s1"), ("acme", "s2")):
        with pytest.raises(SecretError):
            unseal(blob, tenant, secret=secret)
    with pytest.raises(SecretError, match="older format"):
        unseal("sealed:v1:gAAAAA", "acme", secret="s1")


def test_credential_params_are_sealed_others_are_not():
    from orchestrator.secrets import seal_params, unseal_params

    params = {
        "api_key": "a", "aws_secret_access_key": "b", "aws_session_token": "c", "azure_ad_token": "d",
        "vertex_credentials": {"private_key": "e"}, "aws_access_key_id": "f", "client_secret": "g",
        "extra_headers": {"X-Custom": "h"}, "extra_body": {"password": "i", "n": 1},
        "temperature": 0.5, "max_tokens": 10, "api_key_env": "OPENAI_API_KEY", "api_base": "https://x",
    }  # fmt: skip
    sealed = seal_params(params, "acme", secret="s")
    clear_left = [k for k, v in sealed.items() if isinstance(v, str) and not v.startswith("sealed:")]
    assert sorted(clear_left) == ["api_base", "api_key_env"]
    assert sealed["extra_headers"]["X-Custom"].startswith("sealed:")
    assert sealed["extra_body"]["password"].startswith("sealed:") and sealed["extra_body"]["n"] == 1
    assert (sealed["temperature"], sealed["max_tokens"]) == (0.5, 10)
    assert unseal_params(sealed, "acme", secret="s") == params


# -- hole 3: run ids are plain names ------------------------------------------------------------
BAD_RUN_IDS = ["../victim", "/etc", "a/b", "..", "", "x" * 65, "a b", "a.b", "run\n", "é", "a}b"]


@pytest.mark.parametrize("run_id", BAD_RUN_IDS)
def test_run_id_must_be_a_plain_name(client, spec, store, run_id):
    """Failed before the fix: `../victim` and `/etc` were written, and the worker joined them
    to the sandbox root."""
    before = footprint(store)
    with pytest.raises(SpecError) as refused:
        client.submit(spec([{"content": "x"}]), run_id=run_id)
    assert "run_id" in str(refused.value) and "[A-Za-z0-9_-]{1,64}" in str(refused.value)
    with pytest.raises(ValueError, match="run_id"):  # the store refuses too (defence in depth)
        store.create(run_id, RunSpec(prompt="x", model="m"), [])
    assert footprint(store) == before


def test_plain_run_ids_work(client, worker, spec):
    for run_id in (f"Run_{uuid.uuid4().hex[:8]}-1", "x" * 63 + uuid.uuid4().hex[:1]):
        handle = client.submit(spec([{"content": "ok"}]), run_id=run_id)
        assert handle.run_id == run_id and handle.wait(timeout=60).status == Status.completed


# -- hole 4: the tool task's message only names a call --------------------------------------
def forged_message(run_id: str, target: str, tool: str = "write_file") -> dict[str, Any]:
    """A message as a forger writes it to the broker: the old payload's widening fields."""
    return {
        "run_id": run_id, "iteration": 1, "index": 0, "key": "1.0", "call_id": "forged", "tool": tool,
        "arguments": json.dumps({"path": "pwned.txt", "content": "owned"}), "allowed": True,
        "allowed_tools": [tool], "timeout_s": 30, "sandbox_root": target, "bindings": {"db": "theirs"},
        "policy": {"network": True, "memory_mb": 4096, "cpu_s": 600, "allowed_commands": ["sh"]},
        "tenant": "default", "max_output_chars": 50_000, "scrub_model_input": True,
    }  # fmt: skip


def forge_instead_of(d, handle: RunHandle, target: Path, tool: str = "write_file") -> None:
    """Once the run's call waits in its queue, drop its real message and send a forged one."""
    from orchestrator.broker import purge
    from tests.helpers import wait_for

    wait_for(lambda: d.store.state(handle.run_id).get("phase") == "tools", timeout=30)
    stored_tool = json.loads(d.store.redis.hget(d.store.keys.call_args(handle.run_id), "1.0"))["tool"]
    wait_for(lambda: purge(d.client.celery, d.store.keys.tool_queue_of(stored_tool)) == 1, timeout=30)
    d.client.celery.send_task("tooloop.tool", args=(forged_message(handle.run_id, str(target), tool), 5),
                              queue=d.store.keys.tool_queue_of(tool), ignore_result=True)  # fmt: skip


@pytest.fixture
def target() -> Path:
    """A folder of the forger's choice, where the operator allows run folders (another
    tenant's project under TOOLOOP_SANDBOX_ALLOW): the worker would accept it as a run's."""
    folder = Path(os.environ["TOOLOOP_SANDBOX_ALLOW"]) / f"victim-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    return folder


def test_forged_tool_message_runs_only_the_stored_call(deployment, spec, target):
    """Failed before the fix: the forged payload's folder, arguments and policy were used,
    so `pwned.txt` appeared in the forger's folder and the run recorded the forged call."""
    d = deployment()
    d.start_worker("-Q", "turns", "-c", "1", roles=("turns",))  # the call waits in its queue
    s = spec([tools(call("write_file", {"path": "mine.txt", "content": "from the model"}, call_id="c1")),
              {"content": "done"}], tools=["write_file"])  # fmt: skip
    handle = d.client.submit(s)
    forge_instead_of(d, handle, target)
    d.start_worker("-Q", "tools", "-c", "1", roles=("tools",))
    result = handle.wait(timeout=60)
    assert list(target.iterdir()) == []
    assert result.status == Status.completed
    [record] = result.tool_calls
    assert (record.call_id, record.success, record.inputs) == (
        "c1", True, {"path": "mine.txt", "content": "from the model"})  # fmt: skip
    run_dir = Path(d.settings.sandbox_root) / handle.run_id
    assert (run_dir / "mine.txt").read_text() == "from the model" and not (run_dir / "pwned.txt").exists()


def test_forged_message_naming_another_tool_runs_nothing(deployment, spec, target):
    """The stored call is read_file (the only tool the spec allows); a message naming
    write_file for it is dropped, and the sweeper later sends the real call."""
    d = deployment(TOOLOOP_RECOVERY_S="4")
    d.start_worker("-Q", "turns", "-c", "1", roles=("turns",))
    s = spec([tools(call("read_file", {"path": "nothing.txt"}, call_id="c1")), {"content": "done"}],
             tools=["read_file"])  # fmt: skip
    handle = d.client.submit(s)
    forge_instead_of(d, handle, target, tool="write_file")
    d.start_worker("-Q", "tools", "-c", "1", roles=("tools",))
    result = handle.wait(timeout=60)
    assert list(target.iterdir()) == []
    assert result.status == Status.completed
    [record] = result.tool_calls
    assert (record.call_id, record.tool_name, record.success) == ("c1", "read_file", False)
    assert record.inputs == {"path": "nothing.txt"} and "pwned" not in json.dumps(record.model_dump())



# -- 7: a producer configured with TOOLOOP_TENANT submits only for that tenant ------------------
def test_tenant_bound_producer_submits_only_for_its_tenant(store, spec):
    from orchestrator import Client

    bound = Client(settings=store.settings.model_copy(update={"tenant": "acme"}), store=store)
    handle = bound.submit(spec([{"content": "ok"}]))  # names no tenant: gets the producer's
    assert store.state(handle.run_id)["tenant"] == "acme"
    assert store.spec(handle.run_id).tenant == "acme"
    same = bound.submit(RunSpec.model_validate(spec([{"content": "ok"}], tenant="acme")))
    assert store.state(same.run_id)["tenant"] == "acme"
    before = footprint(store)
    for other in (spec([{"content": "x"}], tenant="other"), RunSpec.model_validate(spec([{"content": "x"}],
                                                                                         tenant="default"))):
        with pytest.raises(SpecError) as refused:
            bound.submit(other)
        assert refused.value.errors[0].startswith("tenant: ") and "TOOLOOP_TENANT" in str(refused.value)
    assert footprint(store) == before


def test_cli_with_tooloop_tenant_refuses_another_tenant_with_exit_2(store, tmp_path):
    path = tmp_path / "other.yaml"
    path.write_text("prompt: x\nmodel: openai/m\ntenant: other\n")
    before = footprint(store)
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "TOOLOOP_TENANT": "acme"})  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "tenant: 'other' is not this producer's tenant 'acme'" in out.stderr and out.stdout == ""
    assert footprint(store) == before


# -- 7: a cap on tool calls per turn ------------------------------------------------------------
def test_a_reply_over_the_tool_call_cap_ends_the_run_and_runs_nothing(client, worker, spec, model_server):
    """Failed before the fix: all 3 calls ran (no cap existed)."""
    many = [call("add", {"a": i, "b": 1}, call_id=f"c{i}") for i in range(3)]
    s = spec([tools(*many), {"content": "never"}], tools=["add"], max_tool_calls_per_turn=2)
    result = client.submit(s).wait(timeout=60)
    assert (result.status, result.exit, result.error_type) == (Status.failed, "error", "TooManyToolCalls")
    assert result.error == ("the model's reply asks for 3 tool calls; at most 2 per turn "
                            "(max_tool_calls_per_turn): none was run")  # fmt: skip
    assert result.tool_calls == [] and len(model_server.calls(s["model"])) == 1


def test_a_reply_at_the_tool_call_cap_runs_every_call(client, worker, spec):
    s = spec([tools(call("add", {"a": 1, "b": 1}), call("add", {"a": 2, "b": 2})), {"content": "done"}],
             tools=["add"], max_tool_calls_per_turn=2)  # fmt: skip
    result = client.submit(s).wait(timeout=60)
    assert result.status == Status.completed and [r.output for r in result.tool_calls] == [2, 4]


def test_tool_call_cap_defaults_to_32_and_has_a_ceiling():
    assert RunSpec(prompt="x", model="m").max_tool_calls_per_turn == 32
    for bad in (0, 1001):
        with pytest.raises(ValueError, match="max_tool_calls_per_turn"):
            RunSpec(prompt="x", model="m", max_tool_calls_per_turn=bad)


# -- 7: API tokens ------------------------------------------------------------------------------
def test_api_keeps_token_digests_and_compares_equal_lengths(monkeypatch):
    """Failed before the fix: tokens were kept in clear and compared as given, so the time
    of a comparison depended on the given token's length."""
    import hmac

    from orchestrator import api
    from orchestrator.settings import Settings

    app = api.create_app(Settings(api_tokens="tok-alpha-123=acme, tok-b=beta"))
    tokens = app.state.api.tokens
    assert sorted(tokens.values()) == ["acme", "beta"]
    assert all(isinstance(d, bytes) and len(d) == 32 for d in tokens)  # SHA-256, no token in clear
    assert b"tok-alpha-123" not in tokens and "tok-alpha-123" not in tokens
    lengths: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        lengths.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)  # (orchestrator/tokens.py compares)
    assert api._match_token(tokens, "tok-alpha-123") == "acme"
    assert api._match_token(tokens, "tok-b") == "beta"
    for wrong in ("", "t", "tok-alpha-12", "tok-alpha-1234", "x" * 5000):
        assert api._match_token(tokens, wrong) is None
    assert set(lengths) == {(32, 32)} and len(lengths) == 2 * 7  # every token, every time


@pytest.mark.parametrize("setting", ["t1=acme,t2=beta,t1=beta", "t1=acme, t1 =acme", "=acme", "t1="])
def test_duplicated_or_empty_api_tokens_refuse_to_start(setting):
    """Failed before the fix: a duplicated token silently mapped to the last tenant listed."""
    from orchestrator.api import create_app
    from orchestrator.settings import Settings

    with pytest.raises(ValueError, match="TOOLOOP_API_TOKENS: entry") as refused:
        create_app(Settings(api_tokens=setting))
    assert "t1" not in str(refused.value)  # the message never shows a token
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "api", "--port", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "TOOLOOP_API_TOKENS": setting})  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "TOOLOOP_API_TOKENS: entry" in out.stderr and "t1" not in out.stderr


def test_forged_message_cannot_skip_the_approval_gate(deployment, spec, target):
    """The gate is read from the stored call and spec, not from the message: a forged
    message for a gated call parks it like the real one would. Failed before the fix:
    the forged payload carried no approval flag, and the call ran at once in its folder."""
    from tests.helpers import wait_for

    d = deployment()
    d.start_worker("-Q", "turns", "-c", "1", roles=("turns",))
    s = spec([tools(call("write_file", {"path": "mine.txt", "content": "approved"}, call_id="c1")),
              {"content": "done"}], tools=["write_file"], approval=["write_file"])  # fmt: skip
    handle = d.client.submit(s)
    forge_instead_of(d, handle, target)
    d.start_worker("-Q", "tools", "-c", "1", roles=("tools",))
    [waiting] = wait_for(handle.pending_approvals, timeout=30)
    assert (waiting["call_id"], waiting["tool"]) == ("c1", "write_file") and list(target.iterdir()) == []
    assert handle.approve("c1") == "ok"
    result = handle.wait(timeout=60)
    assert result.status == Status.completed and list(target.iterdir()) == []
    [record] = result.tool_calls
    assert record.success and record.inputs == {"path": "mine.txt", "content": "approved"}
