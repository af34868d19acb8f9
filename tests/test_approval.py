"""Human approval of tool calls: a gated call parks with no worker slot and no lease,
is decided from another process (CLI, API, RunHandle), survives a worker restart,
is fenced (deciding twice takes effect once), waits for a paused run, and times out
into a denial. Real workers, real Redis, the scripted model over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from orchestrator.events import Approval, validate
from orchestrator.models import Status
from tests.helpers import call, tools, wait_for


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def _pending(handle, n: int = 1, timeout: float = 30) -> list[dict]:
    return wait_for(lambda: len(handle.pending_approvals()) >= n and handle.pending_approvals(), timeout)


def _effects(run_id: str) -> list[str]:
    path = os.path.join(os.environ["TOOLOOP_SANDBOX_ROOT"], run_id, "effects.txt")
    return open(path).read().splitlines() if os.path.exists(path) else []


def _approval_events(handle) -> list[Approval]:
    return [e for e in handle.events(timeout=1) if isinstance(e, Approval)]


def test_waits_without_a_slot_then_runs_after_approve_across_a_worker_restart(deployment, spec):
    d = deployment(TOOLOOP_RECOVERY_S="4")  # a quick sweeper: the timed-out call below
    d.start_worker("-c", "1")  # one tool slot: a parked call must not hold it
    gated = d.client.submit(spec([tools(call("append_line", {"text": "once"}, call_id="call_gate")),
                                  {"content": "done"}], tools=["append_line"], approval=["append_line"]))
    late = d.client.submit(spec([tools(call("guarded_append", {"text": "late"})), {"content": "done"}],
                                tools=["guarded_append"], approval_timeout_s=2))  # fmt: skip
    [waiting] = _pending(gated)
    assert (waiting["call_id"], waiting["tool"], waiting["state"]) == ("call_gate", "append_line", "pending")
    # no lease: the call is "dispatched, not started", due only at its approval deadline
    state = d.store.redis.hget(d.store.keys.call_state(gated.run_id), "1.0").decode()
    assert state.startswith("q|") and int(state.split("|")[1]) > time.time() * 1000 + 23 * 3600 * 1000
    # the one tool slot is free: another run's call runs meanwhile
    other = d.client.submit(spec([tools(call("add", {"a": 1, "b": 2})), {"content": "3"}], tools=["add"]))
    assert other.wait(timeout=60).tool_calls[0].output == 3
    assert _effects(gated.run_id) == [] and gated.status() == Status.running
    # the event says what waits, scrubbed like any recorded argument
    [event] = _approval_events(gated)
    assert event.decision == "pending" and json.loads(event.arguments) == {"text": "once"}
    # no decision within approval_timeout_s: the sweeper's re-send denies the call
    [timed_out] = late.wait(timeout=60).tool_calls
    assert not timed_out.success and timed_out.error == "Denied: approval timed out after 2s"
    assert _effects(late.run_id) == [] and _approval_events(late)[-1].by == "timeout"
    # a worker restart in between: the decision is in Redis, not in a worker
    d.stop()
    d.workers.clear()
    d.start_worker("-c", "1")
    listed = _cli(d.env, "list", "--pending", "--json")
    assert [r["run_id"] for r in json.loads(listed.stdout)] == [gated.run_id]
    out = _cli(d.env, "approve", gated.run_id, "call_gate")
    assert out.returncode == 0, out.stderr
    result = gated.wait(timeout=60)
    assert result.status == Status.completed and result.tool_calls[0].success
    assert _effects(gated.run_id) == ["once"]
    # deciding again takes no effect
    again = _cli(d.env, "approve", gated.run_id, "call_gate")
    assert again.returncode == 1 and "ended" in again.stderr
    assert json.loads(_cli(d.env, "list", "--pending", "--json").stdout) == []
    watched = _cli(d.env, "watch", gated.run_id).stdout
    assert "approval pending call=call_gate tool=append_line" in watched
    assert "approval approved call=call_gate tool=append_line by=cli:" in watched


def test_denied_call_reaches_the_model_as_a_failed_record(client, worker, spec, model_server):
    secret = "password=hunter2hunter2"
    s = spec([tools(call("guarded_append", {"text": secret}, call_id="call_no"),
                    call("add", {"a": 1, "b": 1})),
              {"content": "fine"}], tools=["guarded_append", "add"])  # fmt: skip
    handle = client.submit(s)
    _pending(handle)
    shown = json.loads(_approval_events(handle)[0].arguments)["text"]
    assert shown.startswith("password=") and "hunter2hunter2" not in shown  # scrubbed for the person
    assert handle.deny("call_no", reason="not on a Friday", by="tester") == "ok"
    assert handle.approve("call_no") == "already" and handle.deny("call_no") == "already"  # fenced
    result = handle.wait(timeout=60)
    denied, added = result.tool_calls
    assert not denied.success and denied.error == "Denied: not on a Friday"
    assert added.success and added.output == 2  # the ungated call of the same turn ran at once
    assert _effects(handle.run_id) == []
    seen = model_server.calls(s["model"])[1]["messages"]
    assert {"role": "tool", "tool_call_id": "call_no", "content": "Error: Denied: not on a Friday"} in seen
    decisions = [(e.decision, e.by, e.reason) for e in _approval_events(handle)]
    assert decisions == [("pending", None, None), ("denied", "tester", "not on a Friday")]


def test_decisions_wait_for_a_paused_run(client, worker, spec):
    s = spec([tools(call("guarded_append", {"text": "yes"}, call_id="c_yes"),
                    call("guarded_append", {"text": "no"}, call_id="c_no")),
              {"content": "done"}], tools=["guarded_append"])  # fmt: skip
    handle = client.submit(s)
    _pending(handle, 2)
    assert handle.pause() == "ok"
    assert _cli({}, "approve", handle.run_id, "c_yes").returncode == 0
    denied = _cli({}, "deny", handle.run_id, "c_no", "--reason", "too risky")
    assert denied.returncode == 0, denied.stderr
    # the denial is recorded at once; the approved call waits for the resume
    wait_for(lambda: any(e.type == "tool_call" for e in handle.events(timeout=0.5)), 30)
    time.sleep(1)
    assert _effects(handle.run_id) == [] and handle.status() == Status.paused
    assert handle.resume() == "ok"
    result = handle.wait(timeout=60)
    yes, no = result.tool_calls
    assert yes.success and yes.output == 1 and _effects(handle.run_id) == ["yes"]
    assert not no.success and no.error == "Denied: too risky"
    unknown = _cli({}, "approve", handle.run_id, "c_none")
    assert unknown.returncode == 1 and "already ended" in unknown.stderr


def test_api_decisions_are_tenant_scoped(client, worker, spec):
    from fastapi.testclient import TestClient

    from orchestrator.api import create_app
    from orchestrator.settings import Settings

    handle = client.submit(spec([tools(call("guarded_append", {"text": "api"}, call_id="c1"),
                                       call("guarded_append", {"text": "nope"}, call_id="c2")),
                                 {"content": "done"}], tools=["guarded_append"], tenant="acme"))  # fmt: skip
    _pending(handle, 2)
    a, b = {"Authorization": "Bearer tok-a"}, {"Authorization": "Bearer tok-b"}
    with TestClient(create_app(Settings(api_tokens="tok-a=acme,tok-b=other"), client)) as api:
        url = f"/api/runs/{handle.run_id}/calls/c1/approve"
        assert api.post(url, headers=b).status_code == 404  # another tenant's run
        assert api.post(f"/api/runs/{handle.run_id}/calls/nope/approve", headers=a).status_code == 404
        ok = api.post(url, headers=a)
        assert ok.status_code == 200 and ok.json()["result"] == "ok"
        assert api.post(url, headers=a).status_code == 409  # decided once
        deny = f"/api/runs/{handle.run_id}/calls/c2/deny"
        assert api.post(deny, headers=a, json={"reason": "x" * 1001}).status_code == 400  # over the limit
        assert handle.pending_approvals()[0]["call_id"] == "c2"  # ...and nothing decided
        no = api.post(deny, headers=a, json={"reason": "not via API"})
        assert no.status_code == 200 and no.json()["action"] == "deny"
    approved, denied = handle.wait(timeout=60).tool_calls
    assert approved.success and _effects(handle.run_id) == ["api"]
    assert not denied.success and denied.error == "Denied: not via API"


def test_submit_refuses_approval_of_tools_the_run_cannot_call(client, worker, spec):
    from orchestrator import SpecError

    with pytest.raises(SpecError, match="approval"):
        client.submit(spec([{"content": "x"}], tools=["add"], approval=["shell"]))
    assert client.store.catalog()["guarded_append"]["approval"] is True
    from orchestrator.catalog import live_tools

    listed = {t["name"]: t for t in live_tools(client.store)}  # what `tooloop tools` shows
    assert listed["guarded_append"]["approval"] is True and listed["append_line"]["approval"] is False


def test_the_live_view_counts_calls_waiting_for_a_person():
    from orchestrator.views import WatchState

    view = WatchState("r1")
    common = {"id": "1-0", "type": "approval", "ts": "1", "iteration": "1", "tool": "deploy"}
    view.apply(validate({**common, "decision": "pending", "arguments": "{}", "call_id": "a"}))
    view.apply(validate({**common, "decision": "pending", "arguments": "{}", "call_id": "b"}))
    assert view.status == "waiting for 2 approval(s)"
    view.apply(validate({**common, "decision": "denied", "call_id": "a", "by": "timeout"}))
    assert view.status == "waiting for 1 approval(s)"
    view.apply(validate({**common, "decision": "approved", "call_id": "b", "by": "cli:me"}))
    assert view.status == "running"
    assert view.lines[0] == "approval pending call=a tool=deploy arguments={} (tooloop approve|deny RUN a)"
    assert view.lines[2] == "approval denied call=a tool=deploy by=timeout"


# -- issue 11, item 14: deadlines come from Redis's clock, not the caller's -------------
SKEW_S = 3600  # the deciding host runs an hour fast


def _skewed(monkeypatch) -> None:
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + SKEW_S)


def test_approval_and_lease_deadlines_ignore_a_skewed_host_clock(deployment, spec, monkeypatch):
    """Park and decide on a host an hour fast: the approval deadline, the call's lease
    deadline and its lease index score are Redis time plus the duration."""
    from orchestrator import approvals
    from orchestrator.keys import shard_of

    d = deployment()
    d.start_worker("-Q", "turns", "-c", "1", roles=("turns",))  # no tool worker: the call waits
    s = spec([tools(call("guarded_append", {"text": "x"}, call_id="c1")), {"content": "done"}],
             tools=["guarded_append"])  # fmt: skip
    handle = d.client.submit(s)
    cstate, leases = d.store.keys.call_state(handle.run_id), d.store.keys.leases(shard_of(handle.run_id))
    wait_for(lambda: d.store.redis.hget(cstate, "1.0"), timeout=30)
    stored = json.loads(d.store.redis.hget(d.store.keys.call_args(handle.run_id), "1.0"))
    payload = {**stored, "approval_timeout_s": 600}  # as the tool task's view carries it
    _skewed(monkeypatch)

    before = d.store.time_ms()
    assert approvals.park(d.store, payload, {"text": "x"}).verdict == "parked"
    [waiting] = approvals.pending(d.store, handle.run_id)
    assert before + 600_000 <= waiting["deadline"] <= d.store.time_ms() + 600_000

    d.store.redis.zadd(leases, {handle.run_id: before + 10**9})  # a later look: DECIDE lowers it
    before = d.store.time_ms()
    verdict, _, _ = approvals.decide(d.store, handle.run_id, "c1", approved=True)
    after = d.store.time_ms()
    lease_ms = int(d.settings.lease_s * 1000)
    deadline = int(d.store.redis.hget(cstate, "1.0").split(b"|")[1])
    assert verdict == "ok" and before + lease_ms <= deadline <= after + lease_ms
    assert d.store.redis.zscore(leases, handle.run_id) <= after + lease_ms


def test_the_judge_flag_ignores_a_skewed_host_clock(deployment, spec, monkeypatch):
    from worker.supervision import JUDGE_FLAG, claim_judge

    d = deployment()
    handle = d.client.submit(spec([{"content": "x"}]))
    _skewed(monkeypatch)
    before = d.store.time_ms()
    token = claim_judge(d.store, handle.run_id, 1, ttl_s=10)
    held = d.store.redis.hget(d.store.keys.supervisor(handle.run_id), JUDGE_FLAG).decode()
    assert token == held and before + 10_000 <= int(token.split(":")[0]) <= d.store.time_ms() + 10_000


# -- issue 22, item 5: call ids are unique per run --------------------------------------
def test_duplicate_call_ids_are_made_unique_and_decided_apart(client, worker, spec, model_server):
    """A model may repeat a call id (in one reply, or across turns). Each call gets an id of
    its own in the run when the reply is recorded (the first keeps the model's), approvals
    are addressed by it, and the tool message keeps the model's id. Before, both gated calls
    were "dup": `approve dup` decided whichever parked last, the other waited 24 h."""
    s = spec([tools(call("guarded_append", {"text": "one"}, call_id="dup"),
                    call("guarded_append", {"text": "two"}, call_id="dup")),
              tools(call("add", {"a": 1, "b": 2}, call_id="dup")),
              {"content": "done"}], tools=["guarded_append", "add"])  # fmt: skip
    handle = client.submit(s)
    waiting = _pending(handle, 2)
    ids = sorted(w["call_id"] for w in waiting)
    assert len(set(ids)) == 2 and "dup" in ids, ids  # the reply's first call keeps the model's id
    other = next(i for i in ids if i != "dup")
    assert handle.approve(other) == "ok"
    assert [w["call_id"] for w in handle.pending_approvals()] == ["dup"]  # the other one still waits
    assert handle.deny("dup", reason="not this one") == "ok"
    result = handle.wait(timeout=60)
    assert result.status == Status.completed, result.error
    first, second, added = result.tool_calls
    assert (first.call_id, first.success, first.error) == ("dup", False, "Denied: not this one")
    assert (second.call_id, second.success) == (other, True) and _effects(handle.run_id) == ["two"]
    assert added.output == 3 and added.call_id not in ("dup", other)  # unique across turns too
    seen = model_server.calls(s["model"])[2]["messages"]
    assert [m["tool_call_id"] for m in seen if m["role"] == "tool"] == ["dup", "dup", "dup"]  # the model's
