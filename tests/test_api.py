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

from orchestrator import Status
from tests.conftest import ROOT, free_port
from tests.helpers import gate as hold
from tests.helpers import wait_for

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






def sse_events(response: httpx.Response) -> Iterator[dict[str, str]]:
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
    [("GET", "/api/runs"), ("GET", "/api/runs/x"), ("GET", "/api/runs/x/events"),
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
    assert httpx.get(api_server.base_url + "/api/health").json() == {"ok": True}


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
    assert events[2]["tool"] == "add" and events[2]["success"] == "1"
    assert events[-1]["exit"] == "default" and events[-1]["status"] == "completed"
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
    wait_for(lambda: api_server.state.open_streams == 0, timeout=5)  # server side stopped too

    # a follower that never reads: the run goes on at full speed
    with http.stream("GET", f"/api/runs/{handle.run_id}/events"):
        wait_for(lambda: api_server.state.open_streams == 1, timeout=5)
        gate.set()
        assert handle.wait(timeout=20).status == Status.completed
    wait_for(lambda: api_server.state.open_streams == 0, timeout=5)


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
    controls = [e for e in handle.events() if e["type"] == "control"]
    assert [(e["action"], e["by"]) for e in controls] == [("pause", "api:acme"), ("resume", "api:acme")]
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

        wait_for(up, timeout=30, interval=0.2)
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
