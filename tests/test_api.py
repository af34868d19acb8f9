"""The operator HTTP API over real HTTP, against runs handled by a live worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from orchestrator import Status, api
from orchestrator.events import ToolCall, validate
from tests.conftest import ROOT, free_port
from tests.helpers import READY_S, wait_for
from tests.helpers import gate as hold

TOKENS = "tok-acme=acme,tok-globex=globex"


def add_call(delay: float = 0, **extra: Any) -> dict[str, Any]:
    return {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}], "delay": delay, **extra}


@pytest.fixture(scope="module")
def api_server(store) -> Iterator[Any]:
    """The API app served by uvicorn in a thread: real HTTP, and its state is inspectable."""
    import uvicorn

    from orchestrator.api import create_app
    from orchestrator.settings import Settings

    app = create_app(Settings(api_tokens=TOKENS))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=1)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=10)
    server.base_url = f"http://127.0.0.1:{port}"
    server.state = app.state.api
    yield server
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def http(api_server) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=api_server.base_url, headers={"Authorization": "Bearer tok-acme"}, timeout=30
    ) as c:
        yield c


def sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """Parse a text/event-stream: one dict per event (its data), with `_event` and `_id`."""
    frame: dict[str, str] = {}
    for line in response.iter_lines():
        if not line:
            if "data" in frame:
                yield {
                    **json.loads(frame["data"]),
                    "_event": frame.get("event", ""),
                    "_id": frame.get("id", ""),
                }
            frame = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            frame[name] = value


# -- auth ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "method,path",
    [("GET", "/api/runs"), ("POST", "/api/runs"), ("GET", "/api/runs/x"), ("GET", "/api/runs/x/events"),
     ("POST", "/api/runs/x/pause"), ("POST", "/api/runs/x/resume"), ("POST", "/api/runs/x/abort"),
     ("POST", "/api/runs/x/steer")],
)  # fmt: skip
def test_no_or_unknown_token_is_401(api_server, method: str, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic dG9rLWFjbWU6"}):
        response = httpx.request(method, api_server.base_url + path, headers=headers, json={"message": "x"})
        assert response.status_code == 401, (headers, response.text)
        assert response.headers["www-authenticate"] == "Bearer"


def test_openapi_schema_is_served(api_server) -> None:
    schema = httpx.get(api_server.base_url + "/openapi.json").json()
    for path in ("/api/runs", "/api/runs/{run_id}", "/api/runs/{run_id}/events", "/api/runs/{run_id}/steer"):
        assert path in schema["paths"]
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_health_names_workers_and_sandbox_layers_only_to_a_token(api_server, worker) -> None:
    url = api_server.base_url + "/api/health"
    for headers in ({}, {"Authorization": "Bearer not-a-token"}, {"Authorization": "Basic dG9rLWFjbWU="}):
        anonymous = httpx.get(url, headers=headers)
        assert (anonymous.status_code, anonymous.json()) == (200, {"ok": True}), headers
    health = httpx.get(url, headers={"Authorization": "Bearer tok-acme"}).json()
    assert health["ok"] is True
    tools = [w for name, w in health["sandbox"].items() if name.startswith("tools@")]  # per worker
    assert tools and all(isinstance(w["live"], list) and isinstance(w["off"], dict) for w in tools)


def test_openapi_lists_the_status_codes_each_route_answers(api_server) -> None:
    paths = httpx.get(api_server.base_url + "/openapi.json").json()["paths"]
    for path, operations in paths.items():
        for method, op in operations.items():
            codes = set(op["responses"])
            # limit_body answers 400 on any route to a body too large or without a Content-Length
            assert "400" in codes, (method, path)
            assert "Content-Length" in op["responses"]["400"]["description"], (method, path)
            if path.startswith("/api/runs"):
                assert "401" in codes, (method, path)
            if "{run_id}" in path:
                assert {"404", "422"} <= codes, (method, path)
    assert {"201", "401", "422"} <= set(paths["/api/runs"]["post"]["responses"])
    assert "400" in paths["/api/runs/{run_id}/events"]["get"]["responses"]
    assert "400" in paths["/api/runs/{run_id}/steer"]["post"]["responses"]
    for action in ("pause", "resume", "abort", "steer"):
        assert "409" in paths[f"/api/runs/{{run_id}}/{action}"]["post"]["responses"]
    assert "503" in paths["/api/health"]["get"]["responses"]


def test_any_route_refuses_a_body_too_large_or_without_a_size(http) -> None:
    """limit_body answers before the route (or the token check) reads anything."""
    from orchestrator.bounds import API_BODY_MAX_BYTES

    big = b"x" * (API_BODY_MAX_BYTES + 1)
    reply = http.post("/api/runs/no-such-run/pause", content=big)
    assert reply.status_code == 400 and f"{API_BODY_MAX_BYTES:,} bytes" in reply.json()["detail"]
    listed = http.request("GET", "/api/runs", content=big)
    assert listed.status_code == 400

    def chunks() -> Iterator[bytes]:  # no Content-Length: the size cannot be checked first
        yield b"{}"

    chunked = http.request("GET", "/api/health", content=chunks())
    assert chunked.status_code == 400 and "Content-Length" in chunked.json()["detail"]
    assert http.post("/api/runs/no-such-run/pause").status_code == 404  # without a body: the route answers


# -- submitting -----------------------------------------------------------------------------------
def test_submit_over_http_runs_for_the_tokens_tenant(http, client, worker, spec) -> None:
    reply = http.post("/api/runs", json=spec([add_call(), {"content": "3"}], tools=["add"]))
    assert reply.status_code == 201, reply.text
    body = reply.json()
    assert body["status"] == "queued" and body["warnings"] == []
    result = client.get(body["run_id"]).wait(timeout=30)
    assert (result.status, result.content, result.tool_calls[0].output) == (Status.completed, "3", 3)
    assert client.store.state(body["run_id"])["tenant"] == "acme"
    assert http.get(f"/api/runs/{body['run_id']}").json()["content"] == "3"
    # the other tenant cannot see it
    other = http.get(f"/api/runs/{body['run_id']}", headers={"Authorization": "Bearer tok-globex"})
    assert other.status_code == 404


def test_submit_over_http_refuses_exactly_what_the_client_refuses(http, client, worker, spec) -> None:
    from orchestrator import SpecError

    def listed() -> set[str]:
        return {row["run_id"] for row in client.list(1000, "acme")}

    before = listed()
    bad_specs = [
        spec([{"content": "x"}], max_iterations=0, colour="blue"),  # a bad value, an unknown field
        {"model": "openai/x"},  # no prompt
        spec([{"content": "x"}], tools=["no_such_tool"]),  # checked against the live catalog
    ]
    for bad in bad_specs:
        with pytest.raises(SpecError) as refused:
            client.submit(bad)
        reply = http.post("/api/runs", json=bad)
        assert reply.status_code == 422, reply.text
        assert [d["msg"] for d in reply.json()["detail"]] == refused.value.errors
        assert all(d["type"] == "spec_refused" for d in reply.json()["detail"])
    first = http.post("/api/runs", json=bad_specs[0]).json()["detail"]
    assert {tuple(d["loc"]) for d in first} == {("body", "max_iterations"), ("body", "colour")}
    # not a JSON object at all: FastAPI's own 422
    assert http.post("/api/runs", json=["prompt"]).status_code == 422
    broken = http.post("/api/runs", content=b"{", headers={"Content-Type": "application/json"})
    assert broken.status_code == 422
    # another tenant's name in the spec is refused, the token's own is accepted
    reply = http.post("/api/runs", json=spec([{"content": "x"}], tenant="globex"))
    assert reply.status_code == 422 and "acme" in reply.json()["detail"][0]["msg"]
    assert reply.json()["detail"][0]["loc"] == ["body", "tenant"]
    assert listed() == before  # nothing written for any refused spec
    reply = http.post("/api/runs", json=spec([{"content": "ok"}], tenant="acme"))
    assert reply.status_code == 201
    assert client.get(reply.json()["run_id"]).wait(timeout=30).content == "ok"


def test_submit_over_http_takes_a_sandbox_root_only_inside_the_operators_roots(http, client, worker, spec,
                                                                               tmp_path) -> None:  # fmt: skip
    import os

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    refused = http.post("/api/runs", json=spec([{"content": "x"}], context={"sandbox_root": str(outside)}))
    assert refused.status_code == 422
    assert refused.json()["detail"][0]["loc"] == ["body", "context", "sandbox_root"]
    assert not any(outside.iterdir())  # nothing created there
    # a folder under the sandbox root is the run of its name's: this run (its id not drawn yet) is not it
    named = os.path.join(os.environ["TOOLOOP_SANDBOX_ROOT"], f"api-{tmp_path.name}")
    refused = http.post("/api/runs", json=spec([{"content": "x"}], context={"sandbox_root": named}))
    assert refused.status_code == 422 and "run_id=" in refused.json()["detail"][0]["msg"]
    inside = os.path.join(os.environ["TOOLOOP_SANDBOX_ALLOW"], f"api-{tmp_path.name}")
    accepted = http.post("/api/runs", json=spec([{"content": "ok"}], context={"sandbox_root": inside}))
    assert accepted.status_code == 201, accepted.text
    assert client.get(accepted.json()["run_id"]).wait(timeout=30).content == "ok"


# -- reading --------------------------------------------------------------------------------------
def test_tenant_isolation(http, api_server, client, worker, spec, holds) -> None:
    gate = hold(holds)
    ours = client.submit(spec([{"content": "acme's"}], tenant="acme"))
    theirs = client.submit(spec([{"content": "globex's", "hold": gate}], tenant="globex"))
    ours.wait(timeout=30)

    listed = [row["run_id"] for row in http.get("/api/runs", params={"limit": 200}).json()]
    assert ours.run_id in listed and theirs.run_id not in listed
    as_globex = {"Authorization": "Bearer tok-globex"}
    listed = [row["run_id"] for row in http.get("/api/runs", headers=as_globex).json()]
    assert theirs.run_id in listed and ours.run_id not in listed

    # another tenant's run answers exactly like a missing one, and is left alone
    missing = http.get("/api/runs/no-such-run")
    assert missing.status_code == 404
    for method, suffix, body in [("GET", "", None), ("GET", "/events", None), ("POST", "/pause", None),
                                 ("POST", "/abort", None), ("POST", "/steer", {"message": "hi"}),
                                 ("POST", "/resume", None)]:  # fmt: skip
        response = http.request(method, f"/api/runs/{theirs.run_id}{suffix}", json=body)
        assert response.status_code == 404, (suffix, response.text)
        assert response.json()["detail"] == f"no run {theirs.run_id!r}"
    assert theirs.status() in (Status.queued, Status.running)
    gate.set()
    assert theirs.wait(timeout=30).status == Status.completed
    assert http.get(f"/api/runs/{theirs.run_id}", headers=as_globex).json()["content"] == "globex's"


def test_list_and_get_run(http, client, worker, spec) -> None:
    handle = client.submit(spec([add_call(), {"content": "3"}], tools=["add"], tenant="acme"))
    result = handle.wait(timeout=30)
    row = next(r for r in http.get("/api/runs").json() if r["run_id"] == handle.run_id)
    assert row["status"] == "completed" and row["exit"] == "default" and row["tenant"] == "acme"
    assert (row["iteration"], row["tokens_used"]) == (2, result.tokens_used)
    got = http.get(f"/api/runs/{handle.run_id}").json()
    assert got == result.model_dump(mode="json")
    assert got["tool_calls"][0]["output"] == 3
    assert http.get("/api/runs", params={"limit": 0}).status_code == 422


# -- events ---------------------------------------------------------------------------------------
def test_events_of_a_finished_run_replay_and_end(http, client, worker, spec) -> None:
    handle = client.submit(spec([add_call(), {"content": "3"}], tools=["add"], tenant="acme"))
    handle.wait(timeout=30)
    with http.stream("GET", f"/api/runs/{handle.run_id}/events") as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(response))  # returns: the stream ends after the outcome
    assert [e["type"] for e in events] == ["queued", "iteration", "tool_call", "iteration", "outcome"]
    assert all(e["_event"] == e["type"] and e["_id"] == e["id"] for e in events)
    assert events[2]["tool"] == "add" and events[2]["success"] is True and events[1]["iteration"] == 1
    assert events[-1]["exit"] == "default" and events[-1]["status"] == "completed"
    # the same typed JSON as the producer's models: it reads back into equal events
    typed = [validate({k: v for k, v in e.items() if not k.startswith("_")}) for e in events]
    assert typed == list(handle.events()) and isinstance(typed[2], ToolCall)
    assert "arguments" not in json.dumps(events) and '"a": 1' not in json.dumps(events)
    # a reconnecting follower sends Last-Event-ID and gets only what followed it
    with http.stream(
        "GET", f"/api/runs/{handle.run_id}/events", headers={"Last-Event-ID": events[2]["id"]}
    ) as response:
        assert [e["type"] for e in sse_events(response)] == ["iteration", "outcome"]
    bad = http.get(f"/api/runs/{handle.run_id}/events", headers={"Last-Event-ID": "yesterday"})
    assert bad.status_code == 400


def test_events_are_live(http, client, worker, spec, holds) -> None:
    gate = hold(holds)
    handle = client.submit(
        spec([add_call(), {"content": "done", "hold": gate}], tools=["add"], tenant="acme")
    )
    seen: list[str] = []
    with http.stream("GET", f"/api/runs/{handle.run_id}/events") as response:
        for event in sse_events(response):
            seen.append(event["type"])
            if event["type"] == "tool_call":
                # the second turn waits on the gate: this event came while the run was live
                assert handle.status() == Status.running
                gate.set()
    assert seen == ["queued", "iteration", "tool_call", "iteration", "outcome"]


def test_a_follower_that_leaves_is_let_go_and_never_slows_the_run(
    http, api_server, client, worker, spec, model_server, holds
) -> None:
    gate = hold(holds)
    handle = client.submit(spec([{"content": "done", "hold": gate}], tenant="acme"))
    assert api_server.state.open_streams == 0
    with http.stream("GET", f"/api/runs/{handle.run_id}/events") as response:
        events = sse_events(response)  # keep a reference: dropping it closes the connection
        assert next(events)["type"] == "queued"
        assert api_server.state.open_streams == 1
    # A follower re-checks its connection once per XREAD BLOCK (api.BLOCK_MS, 5 s): let go
    # within one, plus slack for a loaded box (a clean-clone CI run missed a 5 s wait).
    let_go_s = api.BLOCK_MS / 1000 + 10
    wait_for(lambda: api_server.state.open_streams == 0, timeout=let_go_s)  # server side stopped too

    # a follower that never reads: the run goes on at full speed
    with http.stream("GET", f"/api/runs/{handle.run_id}/events"):
        wait_for(lambda: api_server.state.open_streams == 1, timeout=5)
        gate.set()
        assert handle.wait(timeout=20).status == Status.completed
    wait_for(lambda: api_server.state.open_streams == 0, timeout=let_go_s)


# -- control: each directive changes a live run handled by the worker -------------------------
def test_pause_then_resume_over_http(http, client, worker, spec, model_server, holds) -> None:
    gate = hold(holds)
    s = spec([add_call(hold=gate), {"content": "resumed"}], tools=["add"], tenant="acme")
    handle = client.submit(s)
    wait_for(lambda: model_server.calls(s["model"]))  # turn 1 is in flight on the worker

    reply = http.post(f"/api/runs/{handle.run_id}/pause")
    assert reply.status_code == 200
    assert reply.json() == {"run_id": handle.run_id, "action": "pause", "result": "ok", "status": "paused"}
    assert http.post(f"/api/runs/{handle.run_id}/pause").json()["result"] == "already"
    gate.set()  # the reply lands; nothing more starts while paused
    time.sleep(1.5)
    assert handle.status() == Status.paused
    assert len(model_server.calls(s["model"])) == 1

    reply = http.post(f"/api/runs/{handle.run_id}/resume")
    assert reply.status_code == 200 and reply.json()["result"] == "ok"
    result = handle.wait(timeout=30)
    assert (result.status, result.content, result.iterations) == (Status.completed, "resumed", 2)
    controls = [e for e in handle.events() if e.type == "control"]
    assert [(e.action, e.by) for e in controls] == [("pause", "api:acme"), ("resume", "api:acme")]
    # directives on an ended run are refused, not silently accepted
    assert http.post(f"/api/runs/{handle.run_id}/pause").status_code == 409
    assert http.post(f"/api/runs/{handle.run_id}/resume").status_code == 409


def test_resume_of_a_running_run_is_409(http, client, worker, spec, model_server, holds) -> None:
    gate = hold(holds)
    s = spec([{"content": "x", "hold": gate}], tenant="acme")
    handle = client.submit(s)
    wait_for(lambda: model_server.calls(s["model"]))
    reply = http.post(f"/api/runs/{handle.run_id}/resume")
    assert reply.status_code == 409 and "not paused" in reply.json()["detail"]
    gate.set()
    handle.wait(timeout=20)


def test_steer_over_http_reaches_the_model(http, client, worker, spec, model_server, holds) -> None:
    gate = hold(holds)
    s = spec([add_call(hold=gate), {"content": "steered"}], tools=["add"], tenant="acme")
    handle = client.submit(s)
    wait_for(lambda: model_server.calls(s["model"]))
    url = f"/api/runs/{handle.run_id}/steer"
    assert http.post(url).status_code == 422  # no body
    assert http.post(url, json={"text": "wrong field"}).status_code == 422
    assert http.post(url, json={"message": "   "}).status_code == 400
    reply = http.post(url, json={"message": "Prefer small numbers."})
    assert reply.status_code == 200 and reply.json()["result"] == "ok"
    gate.set()
    assert handle.wait(timeout=30).status == Status.completed
    second = model_server.calls(s["model"])[1]["messages"]
    assert any(m["role"] == "system" and "Prefer small numbers." in m["content"] for m in second)


def test_abort_over_http_ends_the_run_at_once(http, client, worker, spec, model_server, holds) -> None:
    gate = hold(holds)
    s = spec([add_call(hold=gate), {"content": "never"}], tools=["add"], tenant="acme")
    handle = client.submit(s)
    wait_for(lambda: model_server.calls(s["model"]))
    reply = http.post(f"/api/runs/{handle.run_id}/abort", json={"reason": "wrong prompt"})
    assert reply.status_code == 200 and reply.json()["status"] == "aborted"
    run = http.get(f"/api/runs/{handle.run_id}").json()
    assert (run["status"], run["exit"]) == ("aborted", "aborted")
    assert "api:acme" in run["error"] and "wrong prompt" in run["error"]
    gate.set()  # the in-flight reply arrives and is discarded
    time.sleep(1.0)
    assert http.get(f"/api/runs/{handle.run_id}").json()["tool_calls"] == []
    assert len(model_server.calls(s["model"])) == 1
    assert http.post(f"/api/runs/{handle.run_id}/abort").status_code == 409


# -- metrics ---------------------------------------------------------------------------------------
def test_metrics_page_shows_the_fleet_and_the_apis_own_counts(http, api_server, client, worker, spec,
                                                               model_server, holds) -> None:  # fmt: skip
    from prometheus_client.parser import text_string_to_metric_families

    def samples() -> dict:
        page = httpx.get(api_server.base_url + "/metrics")  # no token needed
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(page.text) for s in f.samples}  # fmt: skip

    aborted = ("tooloop_runs_ended_total", (("exit", "aborted"), ("status", "aborted")))
    before = samples()
    assert before[("tooloop_redis_up", ())] == 1
    prefix = client.store.keys.prefix
    assert (("tooloop_queue_depth", (("queue", f"{prefix}.turns"),))) in before
    gate = hold(holds)
    s = spec([add_call(hold=gate), {"content": "never"}], tools=["add"], tenant="acme")
    handle = client.submit(s)
    wait_for(lambda: model_server.calls(s["model"]))
    assert samples()[("tooloop_live_runs", ())] >= 1
    assert http.post(f"/api/runs/{handle.run_id}/abort").status_code == 200
    assert samples().get(aborted, 0) == before.get(aborted, 0) + 1  # counted once, by the API
    gate.set()


def test_health_and_metrics_say_when_redis_is_away() -> None:
    """/api/health (the API pod's readiness) answers 503 while Redis is away, and 200 again when it
    is back; /metrics still answers, with tooloop_redis_up 0."""
    import uvicorn

    from orchestrator.api import create_app
    from orchestrator.settings import Settings
    from tests.conftest import start_redis

    redis_port = free_port()
    redis_proc = start_redis(redis_port)
    app = create_app(Settings(api_tokens=TOKENS, redis_url=f"redis://127.0.0.1:{redis_port}/0"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=1))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: server.started, timeout=10)
        assert httpx.get(base + "/api/health", timeout=10).status_code == 200
        redis_proc.terminate()
        redis_proc.wait(10)
        away = httpx.get(base + "/api/health", timeout=30)
        assert away.status_code == 503 and away.json()["detail"] == "Redis unreachable"
        page = httpx.get(base + "/metrics", timeout=30)
        assert page.status_code == 200 and "tooloop_redis_up 0.0" in page.text
        redis_proc = start_redis(redis_port)
        assert wait_for(lambda: httpx.get(base + "/api/health", timeout=10).status_code == 200, timeout=30)
        assert "tooloop_redis_up 1.0" in httpx.get(base + "/metrics", timeout=10).text
    finally:
        server.should_exit = True
        thread.join(10)
        redis_proc.terminate()
        redis_proc.wait(10)


# -- the command -------------------------------------------------------------------------------------
def test_tooloop_api_command_serves_and_stops_despite_open_streams(tmp_path, client, spec, holds) -> None:
    port = free_port()
    log = (tmp_path / "api.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "api", "--port", str(port), "-l", "warning"],
        env={**os.environ, "TOOLOOP_API_TOKENS": TOKENS}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    as_globex = {"Authorization": "Bearer tok-globex"}
    try:

        def up() -> bool:
            try:
                return httpx.get(base + "/api/health").status_code == 200
            except httpx.TransportError:
                assert proc.poll() is None, (tmp_path / "api.log").read_text()
                return False

        wait_for(up, timeout=READY_S, interval=0.2)
        assert httpx.get(base + "/api/runs").status_code == 401
        listed = httpx.get(base + "/api/runs", headers=as_globex)
        assert listed.status_code == 200 and isinstance(listed.json(), list)
        assert "/api/runs/{run_id}/abort" in httpx.get(base + "/openapi.json").json()["paths"]

        handle = client.submit(spec([{"content": "x", "hold": hold(holds)}], tenant="globex"))
        with httpx.stream("GET", f"{base}/api/runs/{handle.run_id}/events", headers=as_globex) as response:
            events = sse_events(response)
            assert next(events)["type"] == "queued"
            started = time.monotonic()
            proc.terminate()  # a live follower must not hold up a restart
            proc.wait(20)
        assert time.monotonic() - started < 10
    finally:
        proc.kill()
        proc.wait(10)
