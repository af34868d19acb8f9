"""The supervisor end to end: real workers, the scripted model, rules, detectors, judge."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from orchestrator import Status
from orchestrator.events import Supervisor
from tests.helpers import wait_for

PASS = {"content": json.dumps({"passed": True, "reason": "steady progress"})}
SECRET = "argsecret"  # an argument (and, upper-cased by `lookup`, an output) nobody may see


# -- helpers ------------------------------------------------------------------------
def call(name: str, **arguments: Any) -> dict:
    return {"name": name, "arguments": arguments}


def tools(*calls: dict, **extra: Any) -> dict:
    return {"tool_calls": list(calls), **extra}




def sup_events(store, run_id: str) -> list[Supervisor]:
    return [e for e in store.read_events(run_id, "0", count=1000) if isinstance(e, Supervisor)]


def fired(store, run_id: str) -> list[tuple[str, str, int]]:
    """(rule, action, iteration) of each supervisor event."""
    return [(e.rule, e.action, e.iteration) for e in sup_events(store, run_id)]


def guidance(request: dict, text: str) -> list[dict]:
    """Messages of a model request that carry ``text``, past the first user message (the
    task): steers, of any source."""
    later = request["messages"][2:]
    return [m for m in later if m["role"] in ("system", "user") and text in (m["content"] or "")]


def seen(request: dict, text: str) -> bool:
    return bool(guidance(request, text))


def judge_spec(model_server, steps: list, **fields: Any) -> dict:
    params = {"api_base": model_server.api_base, **fields.pop("model_params", {})}
    return {"model": model_server.script(steps), "model_params": params, **fields}


def assert_metadata_only(store, run_id: str) -> None:
    """The supervisor events as stored (the typed models drop unknown fields: read the stream)."""
    entries = [fields for _, fields in store.redis.xrange(store.keys.events(run_id))
               if fields[b"type"] == b"supervisor"]  # fmt: skip
    assert entries
    for fields in entries:
        event = {k.decode(): v.decode() for k, v in fields.items()}
        assert set(event) <= {"type", "ts", "rule", "action", "iteration", "verdict", "error_type"}
        assert SECRET not in json.dumps(event).lower()


def lookup_turns(n: int, key: str = SECRET) -> list[dict]:
    return [tools(call("lookup", key=key)) for _ in range(n)]


# -- no supervisor ----------------------------------------------------------------------
def test_without_supervisor_block_nothing_runs(client, worker, spec, store):
    s = spec([*lookup_turns(5), {"content": "done"}], tools=["lookup"])
    handle = client.submit(s)
    result = handle.wait(timeout=30)
    assert (result.status, result.iterations) == (Status.completed, 6)
    assert sup_events(store, handle.run_id) == []
    assert not store.redis.exists(store.keys.supervisor(handle.run_id))
    assert not store.redis.exists(store.keys.steer(handle.run_id))


# -- rules ---------------------------------------------------------------------------------
def test_tool_repeated_abort_names_the_rule(client, worker, spec, store, model_server):
    rules = [{"when": "tool_repeated", "count": 3, "then": "abort"}]
    s = spec([*lookup_turns(6), {"content": "never"}], tools=["lookup"],
             supervisor={"rules": rules, "detect_loops": False})  # fmt: skip
    handle = client.submit(s)
    result = handle.wait(timeout=30)
    assert (result.status, result.exit, result.error_type) == (Status.aborted, "aborted", "Aborted")
    assert "supervisor" in result.error and "tool_repeated" in result.error
    assert result.iterations == 3 and len(model_server.calls(s["model"])) == 3
    assert fired(store, handle.run_id) == [("tool_repeated", "abort", 3)]
    assert_metadata_only(store, handle.run_id)


def test_tool_repeated_steer_fires_once_and_reaches_the_model(client, worker, spec, store, model_server):
    rules = [{"when": "tool_repeated", "tool": "lookup", "count": 2, "then": "steer",
              "message": "Stop looking the same key up."}]  # fmt: skip
    steps = [tools(call("add", a=1, b=2)), *lookup_turns(5), {"content": "done"}]
    s = spec(steps, tools=["add", "lookup"], supervisor={"rules": rules, "detect_loops": False})
    handle = client.submit(s)
    assert handle.wait(timeout=30).status == Status.completed
    assert fired(store, handle.run_id) == [("tool_repeated", "steer", 3)]
    requests = model_server.calls(s["model"])
    assert not any(seen(r, "Stop looking the same key up.") for r in requests[:3])
    assert len(guidance(requests[-1], "Stop looking the same key up.")) == 1  # once, not per turn
    # a rule's message is the supervisor's, not the operator's: a user message marked as such
    [steer] = guidance(requests[-1], "Stop looking")
    assert steer == {"role": "user", "content": "[supervisor] Stop looking the same key up."}


def test_budget_fraction_counts_this_turns_reply_then_pause_and_resume(client, worker, spec, store):
    # 30 tokens a reply; 25% of 200 = 50: crossed by turn 2's reply (60), not before it (30)
    rules = [{"when": "budget_fraction", "gt": 0.25, "then": "pause"}]
    steps = [tools(call("add", a=1, b=2)), tools(call("add", a=2, b=2)), {"content": "done"}]
    s = spec(steps, tools=["add"], token_budget=200, supervisor={"rules": rules})
    handle = client.submit(s)
    wait_for(lambda: handle.status() == Status.paused)
    assert fired(store, handle.run_id) == [("budget_fraction", "pause", 2)]
    controls = [e for e in store.read_events(handle.run_id, "0") if e.type == "control"]
    assert (controls[-1].action, controls[-1].by) == ("pause", "supervisor")
    time.sleep(0.5)
    assert handle.status() == Status.paused and handle.result().iterations == 2
    assert handle.resume() == "ok"
    result = handle.wait(timeout=30)
    assert (result.status, result.content, result.tokens_used) == (Status.completed, "done", 90)
    assert len(sup_events(store, handle.run_id)) == 1  # still true at turn 3: not again


@pytest.mark.parametrize("action", ["steer", "pause", "abort"])
def test_iteration_reached_each_action(client, worker, spec, store, model_server, action):
    rules = [{"when": "iteration_reached", "gte": 2, "then": action}]
    steps = [tools(call("add", a=i, b=1)) for i in range(4)] + [{"content": "done"}]
    s = spec(steps, tools=["add"], max_iterations=10, supervisor={"rules": rules})
    handle = client.submit(s)
    if action == "pause":
        wait_for(lambda: handle.status() == Status.paused)
        assert handle.result().iterations == 2
        handle.abort(reason="test over")
    result = handle.wait(timeout=30)
    assert fired(store, handle.run_id) == [("iteration_reached", action, 2)]
    if action == "steer":  # the default text says where the loop stands
        assert result.status == Status.completed
        assert len(guidance(model_server.calls(s["model"])[-1], "This was turn 2 of at most 10")) == 1
    if action == "abort":
        assert result.status == Status.aborted and result.iterations == 2
        assert "supervisor rule iteration_reached" in result.error


# -- loop detectors ------------------------------------------------------------------------
def test_loop_detector_same_call_same_result(client, worker, spec, store, model_server):
    s = spec([*lookup_turns(6), {"content": "done"}], tools=["lookup"], supervisor={})
    handle = client.submit(s)
    assert handle.wait(timeout=30).status == Status.completed
    # three identical results are known once turn 4 runs (this turn's results never are)
    assert fired(store, handle.run_id) == [("loop_repeat", "steer", 4)]
    last = model_server.calls(s["model"])[-1]
    assert len(guidance(last, "returned the same result 3 times in a row")) == 1


def test_loop_detector_not_fooled_by_changing_results(client, worker, spec, store):
    steps = [tools(call("add", a=i, b=1)) for i in range(5)] + [{"content": "done"}]
    s = spec(steps, tools=["add"], supervisor={})
    handle = client.submit(s)
    assert handle.wait(timeout=30).status == Status.completed
    assert fired(store, handle.run_id) == []


def test_loop_detector_ping_pong_abort(client, worker, spec, store):
    steps = [tools(call("add", a=1, b=2)), tools(call("lookup", key="k"))] * 4 + [{"content": "never"}]
    s = spec(steps, tools=["add", "lookup"],
             supervisor={"loop_count": 2, "loop_action": "abort"})  # fmt: skip
    handle = client.submit(s)
    result = handle.wait(timeout=30)
    # A B A B completed by turn 4, seen at turn 5
    assert (result.status, result.iterations) == (Status.aborted, 5)
    assert "loop_pingpong" in result.error
    assert fired(store, handle.run_id) == [("loop_pingpong", "abort", 5)]


# -- the judge -----------------------------------------------------------------------------
def test_judge_pass_sees_metadata_only(client, worker, spec, store, model_server):
    judge = judge_spec(model_server, [PASS], every_n_iterations=2)
    handle = None

    def after_judged(request: dict) -> dict:  # turn 4 waits for turn 2's judgement
        wait_for(lambda: sup_events(store, handle.run_id))
        return tools(call("lookup", key=SECRET))

    steps = [*lookup_turns(3), after_judged, {"content": "done"}]
    s = spec(steps, tools=["lookup"], prompt=f"the prompt {SECRET}",
             supervisor={"judge": judge, "detect_loops": False})  # fmt: skip
    handle = client.submit(s)
    assert handle.wait(timeout=30).status == Status.completed
    judged = wait_for(lambda: model_server.calls(judge["model"]))
    events = wait_for(lambda: sup_events(store, handle.run_id))
    assert {(e.rule, e.action, e.verdict) for e in events} == {("judge", "none", "passed")}
    assert {e.iteration for e in events} <= {2, 4}
    assert_metadata_only(store, handle.run_id)
    # the judge saw iteration, tokens, tool names and counts; no prompt, arguments, outputs
    request = judged[0]
    text = json.dumps(request["messages"]).lower()
    assert SECRET not in text and "do the task" not in text
    brief = json.loads(request["messages"][-1]["content"].split("\n", 1)[1])
    assert brief["iteration"] == 2 and brief["tokens_used"] == 60
    assert brief["calls_by_tool"] == {"lookup": 2} and brief["recent_tools"] == ["lookup", "lookup"]
    assert "tools" not in request  # the judge gets no tool schemas either
    assert not any(seen(r, "found a problem") for r in model_server.calls(s["model"]))  # passed: no steer


def test_judge_fail_steers_with_its_reason(client, worker, spec, store, model_server):
    reason = "You keep adding the same numbers; try another plan."
    judge = judge_spec(model_server, [{"content": json.dumps({"passed": False, "reason": reason})}])

    def until_steered(request: dict) -> dict:
        return {"content": "changed plan"} if seen(request, reason) else tools(call("add", a=1, b=1))

    s = spec([tools(call("add", a=1, b=1)), until_steered], tools=["add"], max_iterations=20,
             supervisor={"judge": judge, "detect_loops": False})  # fmt: skip
    handle = client.submit(s)
    result = handle.wait(timeout=30)
    assert (result.status, result.content) == (Status.completed, "changed plan")
    last = model_server.calls(s["model"])[-1]
    # the verdict is the judge's (a model's text): a user message marked [judge], never system
    # one verdict per judged turn: on a loaded box a second judge may fail the run again
    # before the first steer reaches the model
    steers = guidance(last, reason)
    assert steers and all(m["role"] == "user" and m["content"].startswith("[judge] An automated judge")
                          for m in steers)  # fmt: skip
    assert "Guidance from your operator" not in json.dumps(last["messages"])
    events = sup_events(store, handle.run_id)
    assert ("judge", "steer", "failed") in {(e.rule, e.action, e.verdict) for e in events}
    controls = [e for e in store.read_events(handle.run_id, "0") if e.type == "control"]
    assert any(e.action == "steer" and e.by == "supervisor:judge" for e in controls)


def test_at_most_one_judge_in_flight(client, worker, spec, store, model_server):
    release = threading.Event()
    judge = judge_spec(model_server, [{**PASS, "hold": release}])

    def once_judge_asked(request: dict) -> dict:  # turn 2 starts once turn 1's judge is in flight
        wait_for(lambda: model_server.calls(judge["model"]))
        return tools(call("add", a=1, b=1))

    steps = [tools(call("add", a=0, b=1)), once_judge_asked, *[tools(call("add", a=i, b=1)) for i in (2, 3)],
             {"content": "done"}]  # fmt: skip
    s = spec(steps, tools=["add"], supervisor={"judge": judge})
    handle = client.submit(s)
    try:
        assert handle.wait(timeout=30).status == Status.completed  # the judge never held a turn
        assert len(model_server.calls(judge["model"])) == 1  # turns 2-5 found it in flight
    finally:
        release.set()
    sup_key = store.keys.supervisor(handle.run_id)
    wait_for(lambda: not store.redis.hexists(sup_key, "judge_inflight"))  # released by the judge


@pytest.mark.parametrize(
    ("on_error", "judge_step", "error_type"),
    [
        ("ignore", {"content": "looks fine to me"}, "BadJudgeAnswer"),
        ("pause", {"status": 500, "error": "judge exploded"}, None),
        ("abort", {**PASS, "delay": 3.0}, "Timeout"),  # litellm's timeout or the deadline: one name
    ],
)
def test_judge_error_fail_open_or_closed(client, worker, spec, store, model_server,
                                         on_error, judge_step, error_type):  # fmt: skip
    judge = judge_spec(model_server, [judge_step], on_judge_error=on_error, timeout_s=1,
                       model_params={"max_retries": 0})  # fmt: skip
    hold = threading.Event()  # turn 2's model call waits until the judge's error is handled
    s = spec([tools(call("add", a=1, b=1)), {"content": "done", "hold": hold}], tools=["add"],
             supervisor={"judge": judge})  # fmt: skip
    handle = client.submit(s)
    try:
        [event] = wait_for(lambda: sup_events(store, handle.run_id))
        assert (event.rule, event.action, event.verdict) == ("judge", on_error, "error")
        assert error_type is None or event.error_type == error_type
        assert_metadata_only(store, handle.run_id)
        expected = {"ignore": Status.running, "pause": Status.paused, "abort": Status.aborted}[on_error]
        wait_for(lambda: handle.status() == expected)  # the action follows its event (act after mark_once)
    finally:
        hold.set()
    if on_error == "pause":
        handle.abort(reason="test over")
    result = handle.wait(timeout=30)
    if on_error == "ignore":
        assert (result.status, result.content) == (Status.completed, "done")
    if on_error == "abort":
        assert "judge" in result.error and result.status == Status.aborted
