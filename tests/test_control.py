"""Directives from any process, applied by whichever worker holds the run."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from orchestrator import Status
from tests.helpers import call, process_alive, tools, wait_for


def test_abort_during_model_call_discards_the_reply(client, worker, spec, model_server, store):
    s = spec([tools(call("add", {"a": 1, "b": 1}), delay=2.0), {"content": "never"}], tools=["add"])
    handle = client.submit(s)
    wait_for(lambda: model_server.calls(s["model"]))
    assert handle.abort(reason="wrong prompt", by="tester") == "ok"
    assert handle.status() == Status.aborted  # at once, the reply still in flight
    time.sleep(2.5)  # the reply arrives meanwhile and must be dropped
    result = handle.result()
    assert (result.status, result.exit, result.error_type) == (Status.aborted, "aborted", "Aborted")
    assert "tester" in result.error and "wrong prompt" in result.error
    assert result.tool_calls == [] and result.iterations == 0
    assert len(model_server.calls(s["model"])) == 1
    assert all(m["role"] != "assistant" for m in store.messages(handle.run_id))


def test_abort_during_tool_call_kills_the_tool(client, worker, spec, store):
    s = spec([tools(call("pid_sleeper", {"seconds": 60})), {"content": "never"}], tools=["pid_sleeper"])
    handle = client.submit(s)
    pid_file = os.path.join(os.environ["TOOLOOP_SANDBOX_ROOT"], handle.run_id, "pid.txt")
    pid = int(wait_for(lambda: os.path.exists(pid_file) and Path(pid_file).read_text()))
    assert process_alive(pid)
    handle.abort()
    assert handle.status() == Status.aborted
    wait_for(lambda: not process_alive(pid), timeout=3)
    # the worker keeps serving
    again = client.submit(spec([{"content": "still here"}])).wait(timeout=20)
    assert again.content == "still here"


def test_steer_reaches_the_model_at_the_next_turn(client, worker, spec, model_server):
    s = spec([tools(call("add", {"a": 1, "b": 2}), delay=1.0), {"content": "ok"}], tools=["add"])
    handle = client.submit(s)
    wait_for(lambda: model_server.calls(s["model"]))
    assert handle.steer("Prefer small numbers.") == "ok"
    assert handle.wait(timeout=20).status == Status.completed
    second = model_server.calls(s["model"])[1]["messages"]
    guidance = [m for m in second if m["role"] == "system" and "Prefer small numbers." in m["content"]]
    assert len(guidance) == 1
    assert "does not change your tools, your outcome contract, or the task itself" in guidance[0]["content"]
    assert len([m for m in model_server.calls(s["model"])[0]["messages"] if m["role"] == "system"]) == 1


def test_pause_parks_between_steps_and_resume_continues(client, worker, spec, model_server):
    s = spec([tools(call("add", {"a": 1, "b": 2}), delay=1.0), {"content": "resumed"}], tools=["add"])
    handle = client.submit(s)
    wait_for(lambda: model_server.calls(s["model"]))
    assert handle.pause() == "ok"
    assert handle.status() == Status.paused
    time.sleep(2.0)  # the reply lands; its tool call must not start while paused
    result = handle.result()
    assert result.status == Status.paused and result.iterations == 1 and result.tool_calls == []
    assert len(model_server.calls(s["model"])) == 1
    assert handle.resume() == "ok"
    result = handle.wait(timeout=20)
    assert (result.status, result.content) == (Status.completed, "resumed")
    assert [r.output for r in result.tool_calls] == [3]


def test_pause_at_turn_boundary_then_resume(client, worker, spec, model_server, store):
    s = spec([tools(call("sleepy", {"seconds": 1.0})), {"content": "done"}], tools=["sleepy"])
    handle = client.submit(s)
    wait_for(lambda: handle.result().iterations == 1)
    # pause once the call has started (a call not started yet would wait for the resume)
    wait_for(lambda: (store.redis.hget(store.keys.call_state(handle.run_id), "1.0") or b"x")[:1] in b"sd")
    handle.pause()
    wait_for(lambda: handle.result().tool_calls)  # the started call finishes...
    time.sleep(0.5)
    assert handle.status() == Status.paused  # ...but no next turn starts
    assert len(model_server.calls(s["model"])) == 1
    handle.resume()
    assert handle.wait(timeout=20).content == "done"


def _turn_parked(store, run_id: str) -> bool:
    """The run waits, paused, for its next turn, whose message was taken and dropped (or
    never sent): nothing of it waits in a queue."""
    state = store.state(run_id)
    return (state.get("status"), state.get("phase")) == ("paused", "turn") and (
        int(state.get("turn_taken") or 0) >= int(state.get("turn_gen") or 0))  # fmt: skip


def _call_parked(store, run_id: str, key: str) -> bool:
    """The call waits, paused, and its message was taken and dropped (kind|deadline|attempts|
    generation|taken|...: the call state's fields, orchestrator/scripts.py ``put``)."""
    raw = (store.redis.hget(store.keys.call_state(run_id), key) or b"").decode()
    fields = raw.split("|")
    return store.status(run_id) == Status.paused and len(fields) > 4 and fields[0] == "q" and (
        int(fields[4]) >= int(fields[3]))  # fmt: skip


def test_a_pause_and_resume_is_not_reported_as_a_lost_message(client, worker, spec, model_server, store,
                                                              holds, caplog, monkeypatch):  # fmt: skip
    """Issue 22 item 15: a step parked by a pause (its message taken by a worker that found
    the run paused, or never sent because the run was paused) was told from a step whose
    message waits in its queue only by looking in the queue, where it was gone: each resume
    wrote a `recovery` event, counted tooloop_recoveries_total and logged "message lost;
    sent again". The pause path now says so itself. The three ways a step parks, in one
    run: a turn whose message a worker took (after a corrected reply), a call whose message
    a worker took (a reply landing after the pause), a next turn never sent (the last call
    recorded after the pause)."""
    from prometheus_client import REGISTRY

    from orchestrator import metrics
    from tests.helpers import gate

    monkeypatch.setattr(metrics, "_api_counting", True)  # count here, as `tooloop api` does (count_here)
    metrics.metrics()  # its counters registered: the resumes below run the sweeper's check in this process

    def recoveries() -> dict[str, float | None]:
        steps = ("turn", "tool_call")
        return {s: REGISTRY.get_sample_value("tooloop_recoveries_total", {"step": s}) for s in steps}

    counted = recoveries()
    broken = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": }</tool_call>'  # corrected: 'continue'
    first, second = gate(holds), gate(holds)
    s = spec([{"content": broken, "hold": first}, tools(call("add", {"a": 1, "b": 2}), hold=second),
              tools(call("wait_for_file", {"name": "go"})), {"content": "done"}],
             tools=["add", "wait_for_file"])  # fmt: skip
    caplog.set_level("WARNING", logger="orchestrator.recovery")
    handle = client.submit(s)
    run_id = handle.run_id
    # 1. a turn's message taken by a worker that found the run paused
    wait_for(lambda: len(model_server.calls(s["model"])) == 1)
    assert handle.pause() == "ok"
    first.set()
    wait_for(lambda: _turn_parked(store, run_id) and store.state(run_id).get("iteration") == "1")
    assert handle.resume() == "ok"
    # 2. a call's message taken by a worker that found the run paused
    wait_for(lambda: len(model_server.calls(s["model"])) == 2)
    assert handle.pause() == "ok"
    second.set()
    wait_for(lambda: _call_parked(store, run_id, "2.0"))
    assert handle.resume() == "ok"
    # 3. the last call recorded while paused: the next turn is never sent
    wait_for(lambda: (store.redis.hget(store.keys.call_state(run_id), "3.0") or b"x")[:1] == b"s")
    assert handle.pause() == "ok"
    Path(os.environ["TOOLOOP_SANDBOX_ROOT"], run_id, "go").write_text("")
    wait_for(lambda: _turn_parked(store, run_id) and store.state(run_id).get("iteration") == "3")
    assert handle.resume() == "ok"

    result = handle.wait(timeout=60)
    assert (result.status, result.content) == (Status.completed, "done"), result.error
    assert [r.output for r in result.tool_calls] == [3, "go"]
    assert len(model_server.calls(s["model"])) == 4  # each turn asked once
    kinds = [e.type for e in handle.events()]
    assert "recovery" not in kinds, kinds
    assert not [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
    assert recoveries() == counted  # tooloop_recoveries_total counted none of the resumes


def test_pause_holds_no_worker_slot(deployment, spec):
    d = deployment()
    d.start_worker("-c", "1")
    first = d.client.submit(spec([tools(call("add", {"a": 1, "b": 1}), delay=0.5), {"content": "A"}],
                                 tools=["add"]))  # fmt: skip
    first.pause()
    second = d.client.submit(spec([tools(call("add", {"a": 2, "b": 2})), {"content": "B"}], tools=["add"]))
    assert second.wait(timeout=20).content == "B"
    assert first.status() == Status.paused
    first.resume()
    assert first.wait(timeout=20).content == "A"


def test_pause_longer_than_pause_max_aborts(client, worker, spec):
    steps = [tools(call("add", {"a": 1, "b": 1}), delay=0.5), {"content": "x"}]
    s = spec(steps, tools=["add"], pause_max_s=1)
    handle = client.submit(s)
    handle.pause()
    result = handle.wait(timeout=15)
    assert (result.status, result.exit) == (Status.aborted, "aborted")
    assert "pause_max_s" in result.error


def test_directives_on_ended_or_missing_runs(client, worker, spec, store):
    handle = client.submit(spec([{"content": "quick"}]))
    handle.wait(timeout=20)
    assert handle.abort() == "ended" and handle.pause() == "ended" and handle.steer("x") == "ended"
    assert handle.resume() == "ended"
    assert store.abort("no-such-run") == "missing"
    with pytest.raises(KeyError):
        client.get("no-such-run")


def test_events_are_ordered_metadata(client, worker, spec):
    s = spec([tools(call("add", {"a": 31337, "b": 1})), {"content": "forty-two"}], tools=["add"])
    handle = client.submit(s)
    events = list(handle.events(timeout=20))
    assert [e.type for e in events] == ["queued", "iteration", "tool_call", "iteration", "outcome"]
    assert events[1].tool_calls == 1 and events[2].tool == "add" and events[2].success is True
    assert events[4].exit == "default" and events[4].status == "completed"
    assert events[3].tokens_used == 60
    flat = " ".join(f"{k}={v}" for e in events for k, v in e if k not in ("id", "ts"))
    for secret in ("31337", "31338", "forty-two", "do the task"):
        assert secret not in flat
    # a finished run replays
    assert [e.type for e in handle.events(timeout=5)][-1] == "outcome"
