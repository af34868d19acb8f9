"""Faults beyond a clean kill -9 (issue 11): partitions, stale holders, poison steps,
a sweeper facing bad runs and many runs, lost vs late messages, Redis blips, clocks.

A partition is simulated by SIGSTOP of a worker's whole process group past its lease,
then SIGCONT: the worker wakes up believing it still holds what it took. Each test has
its own deployment with TOOLOOP_RECOVERY_S=6 (leases of 3 s, sweeps every 0.5 s).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from orchestrator import Status
from orchestrator.keys import shard_of
from tests.helpers import call, gate, tools, wait_for


def run_dir(run_id: str) -> Path:
    return Path(os.environ["TOOLOOP_SANDBOX_ROOT"], run_id)


def counted(steps_by_call: list[dict]) -> object:
    """A scripted step that answers differently on each request (the n-th model call of
    this turn gets steps_by_call[n], the last one repeating)."""
    seen: list[int] = []

    def step(_request: dict) -> dict:
        seen.append(1)
        return dict(steps_by_call[min(len(seen), len(steps_by_call)) - 1])

    return step


def holder_of(pid: int, workers: list) -> object:
    """Which of ``workers`` (launcher process groups) a process descends from."""
    launchers = {w.proc.pid: w for w in workers}
    while pid > 1:
        if pid in launchers:
            return launchers[pid]
        status = Path(f"/proc/{pid}/status").read_text()
        pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
    raise AssertionError("not a worker's process")


def queue_length(store, queue: str) -> int:
    """Messages waiting in a broker queue and its per-tool sub-queues (Redis lists)."""
    total = 0
    for key in store.redis.scan_iter(f"{store.keys.broker_prefix}{queue}*", count=1000):
        if store.redis.type(key) == b"list":
            total += store.redis.llen(key)
    return total


# -- item 1: a stale turn ends a healthy run -------------------------------------------
def test_a_stale_turn_cannot_end_a_healthy_run(deployment, spec, model_server, holds):
    """A holds turn 1 and is partitioned; B redoes turn 1 and the run moves on; A then
    wakes up to a provider error: the run must not end on A's say."""
    d = deployment()
    a = d.start_worker("-c", "4")
    a_answer, last = gate(holds), gate(holds)
    turn1 = counted([{"status": 400, "error": "late provider error", "hold": a_answer},
                     tools(call("add", {"a": 1, "b": 2}))])  # fmt: skip
    s = spec([turn1, {"content": "done", "hold": last}], tools=["add"])
    handle = d.client.submit(s)
    wait_for(lambda: model_server.calls(s["model"]))
    b = d.start_worker("-c", "4")
    a.freeze()
    wait_for(lambda: len(model_server.calls(s["model"])) >= 3, timeout=40)  # B did turn 1, asks turn 2
    a.thaw()
    a_answer.set()  # A's model call fails now: A must not end (or rewind) the run
    time.sleep(2)
    assert not handle.status().ended, handle.result()
    last.set()
    result = handle.wait(timeout=30)
    assert (result.status, result.content, result.iterations) == (Status.completed, "done", 2), result
    assert [r.output for r in result.tool_calls] == [3]
    assert b.proc.poll() is None


# -- item 2: leases have owners -------------------------------------------------------
def test_a_stale_turn_holder_does_not_keep_another_claim_alive(deployment, spec, model_server, holds):
    """A (partitioned) comes back still inside its model call; B, who took the turn over,
    died meanwhile. A's heartbeats must not keep B's claim alive: the turn is recovered."""
    d = deployment()
    a = d.start_worker("-c", "4")
    forever = gate(holds)
    turn1 = counted([{"content": "A's", "hold": forever}, {"content": "B's", "hold": forever},
                     {"content": "recovered"}])  # fmt: skip
    s = spec([turn1])
    handle = d.client.submit(s)
    wait_for(lambda: model_server.calls(s["model"]))
    b = d.start_worker("-c", "4")
    a.freeze()
    wait_for(lambda: len(model_server.calls(s["model"])) == 2, timeout=40)  # B claimed turn 1
    b.kill()
    a.thaw()
    killed_at = time.monotonic()
    result = handle.wait(timeout=40)
    assert result.content == "recovered", result
    assert time.monotonic() - killed_at < 6 + 10  # within TOOLOOP_RECOVERY_S, plus slack


def test_a_taken_over_call_holder_records_nothing(deployment, spec):
    """An idempotent call's holder is partitioned past its lease; another worker runs the
    call again; the first one wakes up: its late result is dropped, never recorded."""
    d = deployment()
    workers = [d.start_worker("-c", "2"), d.start_worker("-c", "2")]
    s = spec([tools(call("tagged_sleep", {"seconds": 8})), {"content": "ok"}], tools=["tagged_sleep"])
    handle = d.client.submit(s)
    folder = run_dir(handle.run_id)
    [first] = wait_for(lambda: list(folder.glob("started-*")), timeout=30)
    first_pid = int(first.name.split("-")[1])
    holder = holder_of(first_pid, workers)
    holder.freeze()
    wait_for(lambda: len(list(folder.glob("started-*"))) == 2, timeout=30)  # taken over: run again
    holder.thaw()
    result = handle.wait(timeout=40)
    [record] = result.tool_calls
    assert record.success and record.output != first_pid, "the taken-over holder's result was recorded"
    assert (folder / f"started-{record.output}").exists()


# -- item 3: poison steps -------------------------------------------------------------
def test_a_poison_tool_call_ends_the_run_within_its_attempt_cap(deployment, spec, model_server):
    """A tool call with ``function.name: null`` raises in the tool task every time."""
    d = deployment()
    d.start_worker("-c", "2")
    s = spec([tools(call(None, {})), {"content": "never"}], tools=["add"])
    handle = d.client.submit(s)
    result = handle.wait(timeout=45)
    assert (result.status, result.exit) == (Status.failed, "error"), result
    assert "3 attempts" in result.error
    [record] = result.tool_calls
    assert not record.success and "3 attempts" in record.error
    assert len(model_server.calls(s["model"])) == 1


def test_a_poison_turn_ends_the_run_and_bills_every_reply(deployment, spec, model_server):
    """A reply that cannot be recorded (a lone surrogate in its text) raises after the
    model call, every time: the run ends on error at the cap, each reply billed."""
    d = deployment()
    d.start_worker("-c", "2")
    s = spec([{"content": "bad \ud800 text", "tokens": 40}])
    handle = d.client.submit(s)
    result = handle.wait(timeout=45)
    assert (result.status, result.exit) == (Status.failed, "error"), result
    assert "3 attempts" in result.error
    assert len(model_server.calls(s["model"])) == 3
    assert result.tokens_used == 3 * 40


# -- item 4: one bad run must not stop recovery ---------------------------------------
def test_one_unreadable_run_does_not_stop_recovery(deployment, spec, model_server):
    """A paused run whose spec no longer parses, and a run whose stored call payload is
    garbage, sit first in the lease index; another run's lost turn is still recovered."""
    d = deployment()
    turns = d.start_worker("-Q", "turns", "-c", "2", roles=("turns",))
    tools_worker = d.start_worker("-Q", "tools", "-c", "2", roles=("tools",))
    garbled = d.client.submit(spec([tools(call("add", {"a": 1, "b": 1}), delay=2.0), {"content": "x"}],
                                   tools=["add"]))  # fmt: skip
    tools_worker.stop()  # before the model answers: its call waits in the queue
    wait_for(lambda: d.store.redis.hget(d.store.keys.call_args(garbled.run_id), "1.0"), timeout=30)
    d.store.redis.hset(d.store.keys.call_args(garbled.run_id), "1.0", "{not json")
    turns.stop()  # from now on nothing consumes: the next runs' messages wait, then are lost
    paused = d.client.submit(spec([{"content": "x"}], pause_max_s=0.5))
    assert paused.pause() == "ok"
    raw = json.loads(d.store.redis.hget(d.store.keys.run(paused.run_id), "spec"))
    d.store.redis.hset(d.store.keys.run(paused.run_id), "spec", json.dumps({**raw, "retired_field": 1}))
    healthy = d.client.submit(spec([{"content": "fine"}]))
    for queue in (d.store.keys.turn_queue, d.store.keys.tool_queue):
        for key in d.store.redis.scan_iter(f"{d.store.keys.broker_prefix}{queue}*"):
            d.store.redis.delete(key)  # every message is lost
    time.sleep(1)  # the paused run is past its pause_max_s: first in the lease index
    d.start_worker("-Q", "turns", "-c", "2", roles=("turns",))
    assert healthy.wait(timeout=40).content == "fine"
    assert paused.wait(timeout=15).status == Status.aborted  # paused past pause_max_s
    result = garbled.wait(timeout=15)
    assert (result.status, result.exit) == (Status.failed, "error"), result


# -- item 5: re-send what is lost, not what is late -------------------------------------
def test_waiting_turns_keep_one_message_each(deployment, spec, model_server):
    """No turn worker for several lease periods: the sweeper (on a tools worker) must not
    pile copies of the waiting turns into the queue; they run once when turns come back."""
    d = deployment()
    d.start_worker("-Q", "tools", "-c", "2", roles=("tools",))
    s = spec([{"content": "ok"}])
    handles = [d.client.submit(s) for _ in range(5)]
    time.sleep(12)  # four leases: the old sweeper re-sent every step every 3.5 s
    assert queue_length(d.store, d.store.keys.turn_queue) == 5
    d.start_worker("-Q", "turns", "-c", "4", roles=("turns",))
    assert all(h.wait(timeout=40).content == "ok" for h in handles)
    assert len(model_server.calls(s["model"])) == 5


def test_waiting_tool_calls_keep_one_message_each(deployment, spec):
    """The tool pool is out (frozen) for several lease periods while turns keep sweeping:
    at most one message per waiting call; each call runs once when the pool is back."""
    # leases of 3 s: the pool is out at most 20 s (queueing) + 20 s (watching) < the 50 s after
    # which a tool no live worker publishes makes its calls fail
    d = deployment(TOOLOOP_RECOVERY_S="10")
    d.start_worker("-Q", "turns", "-c", "4", roles=("turns",))
    pool = d.start_worker("-Q", "tools", "-c", "2", roles=("tools",))
    s = spec([tools(call("append_line", {"text": "once"}), delay=2.0), {"content": "ok"}],
             tools=["append_line"])  # fmt: skip
    handles = [d.client.submit(s) for _ in range(5)]
    pool.freeze()  # before the model answers: the calls are dispatched to a pool that is out
    wait_for(lambda: queue_length(d.store, d.store.keys.tool_queue) == 5, timeout=20)
    peak = 0
    for _ in range(40):  # 20 s: four leases
        time.sleep(0.5)
        peak = max(peak, queue_length(d.store, d.store.keys.tool_queue))
    assert peak == 5, f"{peak} messages for 5 waiting calls"
    pool.thaw()
    for handle in handles:
        result = handle.wait(timeout=40)
        assert [r.output for r in result.tool_calls] == [1], result
        assert (run_dir(handle.run_id) / "effects.txt").read_text() == "once\n"


def test_a_resume_keeps_one_message_per_waiting_call(deployment, spec):
    """Pause then resume while the tool pool is out: the call's message still waits in
    its queue, so the resume adds none; the call runs once when the pool is back."""
    d = deployment()
    d.start_worker("-Q", "turns", "-c", "2", roles=("turns",))
    pool = d.start_worker("-Q", "tools", "-c", "2", roles=("tools",))
    s = spec([tools(call("append_line", {"text": "once"}), delay=2.0), {"content": "ok"}],
             tools=["append_line"])  # fmt: skip
    handle = d.client.submit(s)
    pool.freeze()  # before the model answers: the call is dispatched to a pool that is out
    wait_for(lambda: queue_length(d.store, d.store.keys.tool_queue) == 1, timeout=20)
    assert handle.pause() == "ok" and handle.resume() == "ok"
    assert queue_length(d.store, d.store.keys.tool_queue) == 1
    pool.thaw()
    result = handle.wait(timeout=40)
    assert [r.output for r in result.tool_calls] == [1], result
    assert (run_dir(handle.run_id) / "effects.txt").read_text() == "once\n"


def test_a_resume_keeps_one_message_per_waiting_turn(deployment, spec, model_server):
    """No turn worker yet: a pause then resume leaves the queued turn's one message."""
    d = deployment()
    s = spec([{"content": "ok"}])
    handle = d.client.submit(s)
    assert handle.pause() == "ok" and handle.resume() == "ok"
    assert queue_length(d.store, d.store.keys.turn_queue) == 1
    d.start_worker("-Q", "turns", "-c", "2", roles=("turns",))
    assert handle.wait(timeout=40).content == "ok"
    assert len(model_server.calls(s["model"])) == 1


# -- item 6: abort keeps the in-flight call's record -----------------------------------
def test_abort_records_the_killed_call(deployment, spec):
    d = deployment()
    d.start_worker("-c", "2")
    s = spec([tools(call("sleepy", {"seconds": 30})), {"content": "never"}], tools=["sleepy"])
    handle = d.client.submit(s)
    wait_for(lambda: (d.store.redis.hget(d.store.keys.call_state(handle.run_id), "1.0") or b"")
             .startswith(b"s"), timeout=30)  # fmt: skip
    assert handle.abort() == "ok"
    records = wait_for(lambda: d.store.result(handle.run_id).tool_calls, timeout=10)
    [record] = records
    assert not record.success and record.error.startswith("Aborted"), record
    assert d.store.result(handle.run_id).status == Status.aborted
    ttl = d.store.redis.ttl(d.store.keys.calls(handle.run_id))
    assert 0 < ttl <= d.settings.retention_s


# -- item 7: a call goes only to a worker that has its tool ----------------------------
def test_a_call_is_never_run_by_a_worker_without_the_tool(deployment, spec):
    d = deployment()
    d.start_worker("-Q", "turns", "-c", "4", roles=("turns",))
    full = d.start_worker("-Q", "tools", "-c", "2", roles=("tools",))
    bare = extra_worker(d, "bare", {"TOOLOOP_TOOLS": ""}, "-Q", "tools")  # built-ins only: no `add`
    full.freeze()  # only the bare worker consumes now
    s = spec([tools(call("add", {"a": 20, "b": 22})), {"content": "ok"}], tools=["add"])
    handles = [d.client.submit(s) for _ in range(3)]
    time.sleep(3)
    full.thaw()
    for handle in handles:
        [record] = handle.wait(timeout=40).tool_calls
        assert record.success and record.output == 42, record
    assert bare.proc.poll() is None


def test_a_tool_no_live_worker_has_fails_after_a_while(deployment, spec):
    """The only worker with `add` leaves while a call of it waits: after a while (five
    recovery periods without any live worker publishing the tool) it is recorded failed."""
    d = deployment(TOOLOOP_RECOVERY_S="4")
    d.start_worker("-Q", "turns", "-c", "4", roles=("turns",))
    full = d.start_worker("-Q", "tools", "-c", "2", roles=("tools",))
    extra_worker(d, "bare", {"TOOLOOP_TOOLS": ""}, "-Q", "tools")
    s = spec([tools(call("add", {"a": 1, "b": 1}), delay=2.0), {"content": "went on"}], tools=["add"])
    handle = d.client.submit(s)
    full.stop()  # before the model answers: the call is dispatched after it left
    result = handle.wait(timeout=60)
    assert result.content == "went on", result
    [record] = result.tool_calls
    assert not record.success and "no live worker" in record.error, record


def test_a_call_waits_for_a_tools_worker_that_starts_after_it(deployment, spec):
    """A tool no worker has published yet (the tools workers start after the turns workers,
    as a fresh deployment's may) is not "missing for a while" from the start: its call waits
    a whole unroutable period from when the sweeper first finds it queued. Failed before:
    the first sweep that found it waiting recorded it `UnknownTool` (never seen = seen at 0)."""
    d = deployment(TOOLOOP_RECOVERY_S="4")  # leases 2 s, calls "unroutable" after 20 s
    d.start_worker("-Q", "turns", "-c", "4", roles=("turns",))
    s = spec([tools(call("write_file", {"path": "late.txt", "content": "x"})), {"content": "done"}],
             tools=["write_file"])  # fmt: skip
    handle = d.client.submit(s)
    wait_for(lambda: d.store.state(handle.run_id).get("phase") == "tools", timeout=30)
    time.sleep(8)  # four leases: several sweeps find the call waiting in its tool's queue
    assert d.store.result(handle.run_id).tool_calls == []  # not recorded failed meanwhile
    d.start_worker("-Q", "tools", "-c", "2", roles=("tools",))
    [record] = handle.wait(timeout=60).tool_calls
    assert record.success, record


def extra_worker(d, name: str, env: dict[str, str], *args: str):
    """A worker of deployment ``d`` with its own environment (tools, clock...)."""
    from orchestrator.local import WorkerProcess

    roles = ("tools",) if args[-1:] == ("tools",) else ("turns", "tools")
    proc = WorkerProcess(f"{d.prefix}-{name}", *args, "-c", "2", env={**d.env, **env})
    d.workers.append(proc)
    return proc.wait_ready(d.store, roles)


# -- item 8: a Redis blip at record time ------------------------------------------------
def test_a_redis_blip_at_record_time_keeps_the_result(deployment, spec, aof_redis):
    own_redis = aof_redis
    d = deployment(TOOLOOP_REDIS_URL=own_redis.url, TOOLOOP_RECOVERY_S="24")  # records retry a lease: 6 s
    d.start_worker("-c", "2")
    s = spec([tools(call("append_then_sleep", {"text": "once", "seconds": 2})), {"content": "ok"}],
             tools=["append_then_sleep"])  # fmt: skip
    handle = d.client.submit(s)
    wait_for(lambda: (run_dir(handle.run_id) / "effects.txt").exists(), timeout=30)
    own_redis.proc.terminate()  # down while the call ends and records
    own_redis.proc.wait(timeout=10)
    time.sleep(3.5)
    own_redis.start()
    result = handle.wait(timeout=60)
    [record] = result.tool_calls
    assert record.success and record.output == 1, record
    assert (run_dir(handle.run_id) / "effects.txt").read_text() == "once\n"


# -- item 9: pause expiry races a resume -------------------------------------------------
def test_pause_expiry_never_aborts_a_resumed_run(deployment, spec):
    from orchestrator.recovery import reenqueue

    d = deployment()
    handle = d.client.submit(spec([{"content": "x"}], pause_max_s=0.2))
    assert handle.pause() == "ok"
    time.sleep(0.5)
    recovery = d.store.recover(handle.run_id)  # the sweeper's look: the pause has expired
    resumed = d.client.resume(handle.run_id)  # an operator resumes meanwhile
    if recovery is not None:
        reenqueue(d.store, recovery, d.client.celery)  # the sweeper acts on what it saw
    status = d.store.status(handle.run_id)
    assert not (resumed == "ok" and status == Status.aborted), "a resumed run was aborted"


# -- item 10: the sweeper scales --------------------------------------------------------
def test_one_sweep_recovers_thousands_of_lost_runs(deployment, spec):
    """2,000 runs whose first turn message was lost: one sweep re-sends all of them."""
    from orchestrator.models import RunSpec
    from worker.maintenance import Maintenance

    d = deployment(TOOLOOP_RECOVERY_S="1")
    run_spec = RunSpec.model_validate(spec([{"content": "x"}]))
    ids = [f"lost-{i}" for i in range(2000)]
    for run_id in ids:
        d.store.create(run_id, run_spec, [{"role": "user", "content": "u"}])
    time.sleep(0.7)  # past the dispatch deadline (lease 0.5 s)
    Maintenance(d.store, "test-sweeper", {}, d.client.celery).sweep()
    recovered = 0
    for run_id in ids:
        events = d.store.read_events(run_id, count=10)
        recovered += any(e.type == "recovery" for e in events)
    assert recovered == len(ids)


# -- item 11: turns never time out -------------------------------------------------------
def test_a_model_reply_that_trickles_forever_is_cut_by_the_call_timeout(deployment, spec, model_server):
    """The reply trickles in forever (each read well within any per-read timeout): the
    whole call is cut at ``model_params.timeout``, retried as the spec says, and the run
    ends on error; no turn holds the run beyond its calls' bound."""
    d = deployment()
    d.start_worker("-c", "4")
    s = spec([{"content": "never", "trickle": 600}], model_params={"timeout": 2, "num_retries": 1})
    handle = d.client.submit(s)
    started = time.monotonic()
    result = handle.wait(timeout=60)
    assert (result.status, result.exit, result.error_type) == (Status.failed, "error", "Timeout"), result
    assert len(model_server.calls(s["model"])) == 2
    assert time.monotonic() - started < 2 * 2 + 15  # two cut calls, a backoff, slack


def test_a_turn_stuck_past_its_bound_stops_holding_its_lease(deployment, spec):
    """The backstop when a turn hangs outside the model call (where no timeout reaches):
    past ``max_s`` its heartbeat stops, so the lease lapses and the sweeper can act."""
    from orchestrator.models import RunSpec
    from orchestrator.store import Held, new_owner
    from worker.maintenance import InFlight

    d = deployment()
    run_spec = RunSpec.model_validate(spec([{"content": "x"}]))
    gen = d.store.create("stuck-turn", run_spec, [{"role": "user", "content": "u"}])
    owner = new_owner()
    assert not isinstance(d.store.claim_turn("stuck-turn", 1, gen, owner), str)
    lease = d.settings.lease_s

    def deadline() -> int:
        return int(d.store.state("stuck-turn")["turn_deadline"])

    inflight = InFlight()
    with inflight.hold(d.store, Held("stuck-turn", "turn", "", owner, 1), max_s=lease):
        time.sleep(lease * 0.9)
        beaten = deadline()  # extended while within max_s
        time.sleep(lease * 1.6)  # past max_s: no more beats
        assert d.store.time_ms() > deadline(), "a turn past its bound still holds its lease"
    assert beaten > d.store.time_ms() - lease * 1000 * 1.6


def test_a_step_whose_holders_are_lost_gets_more_attempts_than_one_that_raises(deployment, spec):
    """The attempts cap (3) stops a step whose attempt raised; a step whose holders were only
    lost (their leases lapsed: killed, frozen) is sent again up to three times the cap. Under
    bench/chaos.py's kills a healthy turn lost three holders in a row and its run ended on
    error; a step that kills its worker each time still ends, a few workers later."""
    from orchestrator.models import RunSpec
    from orchestrator.store import new_owner

    d = deployment(TOOLOOP_RECOVERY_S="2")  # leases of 1 s; no worker: the test plays them
    cap, run_spec = d.settings.step_attempts, RunSpec.model_validate(spec([{"content": "x"}]))

    def lose_holders(run_id: str, gen: int, times: int) -> tuple[int, str]:
        """Claim the turn and let the lease lapse, ``times`` times: (generation, last outcome)."""
        outcome = "steps"
        for _ in range(times):
            claim = d.store.claim_turn(run_id, 1, gen, new_owner())
            if isinstance(claim, str):
                return gen, claim
            time.sleep(d.settings.lease_s + 0.2)
            recovery = d.store.recover(run_id)
            outcome = recovery.outcome
            if recovery.outcome == "gave_up":
                return gen, outcome
            [sent] = recovery.sends
            gen = sent.gen
        return gen, outcome

    lost = d.store.create("lost-holders", run_spec, [{"role": "user", "content": "u"}])
    gen, outcome = lose_holders("lost-holders", lost, cap + 1)
    assert outcome == "steps" and not d.store.status("lost-holders").ended  # past the cap, still on
    _, outcome = lose_holders("lost-holders", gen, 3 * cap)
    assert outcome == "gave_up" and d.store.result("lost-holders").error_type == "StepFailed"

    raised = d.store.create("raised", run_spec, [{"role": "user", "content": "u"}])
    owner = new_owner()
    assert not isinstance(d.store.claim_turn("raised", 1, raised, owner), str)
    assert d.store.fail_turn("raised", 1, owner, 0, "ValueError: poison") == "retry"
    _, outcome = lose_holders("raised", d.store.recover("raised").sends[0].gen, cap)
    assert outcome == "gave_up" and d.store.status("raised").ended  # within the cap


# -- item 12: keys that grow ----------------------------------------------------------
def test_expired_runs_leave_the_indexes(deployment, spec):
    d = deployment(TOOLOOP_RETENTION_S="1")
    d.start_worker("-c", "2")
    handle = d.client.submit(spec([{"content": "x"}], tenant="acme"))
    handle.wait(timeout=30)
    wait_for(lambda: d.store.status(handle.run_id) is None, timeout=10)  # expired
    shard = shard_of(handle.run_id)
    wait_for(lambda: not d.store.redis.zscore(d.store.keys.runs(shard), handle.run_id)
             and not d.store.redis.zscore(d.store.keys.tenant_runs("acme", shard), handle.run_id),
             timeout=30)  # fmt: skip


def test_call_state_holds_only_the_current_turn(deployment, spec):
    d = deployment()
    d.start_worker("-c", "2")
    steps = [tools(call("add", {"a": i, "b": 1}), call("add", {"a": i, "b": 2})) for i in range(3)]
    handle = d.client.submit(spec([*steps, {"content": "done"}], tools=["add"]))
    result = handle.wait(timeout=40)
    assert len(result.tool_calls) == 6
    assert d.store.redis.hlen(d.store.keys.call_state(handle.run_id)) == 0


def test_the_steer_list_is_capped(deployment, spec):
    d = deployment()
    handle = d.client.submit(spec([{"content": "x"}]))
    verdicts = [handle.steer(f"note {i}") for i in range(150)]
    assert d.store.redis.llen(d.store.keys.steer(handle.run_id)) <= 100
    assert verdicts[0] == "ok" and verdicts[-1] == "full"


# -- item 13: create is one script --------------------------------------------------------
def test_a_refused_create_touches_nothing(deployment, spec):
    from orchestrator.models import RunSpec

    d = deployment()
    first = RunSpec.model_validate(spec([{"content": "x"}], tenant="first"))
    other = RunSpec.model_validate(spec([{"content": "x"}], tenant="other"))
    d.store.create("dup-run", first, [])
    shard = shard_of("dup-run")
    before = d.store.redis.zscore(d.store.keys.leases(shard), "dup-run")
    time.sleep(0.05)
    with pytest.raises(ValueError):
        d.store.create("dup-run", other, [])
    assert d.store.redis.zscore(d.store.keys.tenant_runs("other", shard), "dup-run") is None
    assert d.store.redis.zscore(d.store.keys.leases(shard), "dup-run") == before


# -- item 14: clocks ------------------------------------------------------------------------
SKEWED_CLOCK = Path(__file__).parent / "fixtures" / "skewed_clock"  # its sitecustomize skews time.time


def logged_ahead(log: str) -> float:
    """How far ahead of this process's clock a worker's latest log line is stamped (s)."""
    from datetime import datetime

    stamps = re.findall(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", log, re.M)
    latest = datetime.strptime(stamps[-1], "%Y-%m-%d %H:%M:%S,%f")
    return (latest - datetime.now()).total_seconds()


def test_a_worker_with_a_fast_clock_does_not_stretch_its_lease(deployment, spec, model_server, holds):
    """A worker whose clock runs 2 minutes ahead claims a turn and dies: the turn is
    recovered within the bound (lease deadlines come from Redis, not the worker's clock)."""
    d = deployment()
    inherited = d.env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))
    path = os.pathsep.join(filter(None, [str(SKEWED_CLOCK), inherited]))
    skewed = extra_worker(d, "skewed", {"PYTHONPATH": path, "TOOLOOP_TEST_CLOCK_SKEW_S": "120"})
    s = spec([counted([{"content": "lost", "hold": gate(holds)}, {"content": "recovered"}])])
    handle = d.client.submit(s)
    wait_for(lambda: model_server.calls(s["model"]), timeout=30)
    assert logged_ahead(skewed.tail()) > 100, "the worker's clock is not skewed"
    d.start_worker("-c", "2")
    skewed.kill()
    killed_at = time.monotonic()
    assert handle.wait(timeout=60).content == "recovered"
    assert time.monotonic() - killed_at < 6 + 10


def test_a_tool_call_whose_run_spec_stops_parsing_ends_the_run(deployment, spec):
    """A call waits in its queue while its run's stored spec stops parsing: the tool task
    that takes it ends the run on error (``SpecUnreadable``), as a turn does. Before, it
    raised past its claim, so the call's lease lapsed and the sweeper sent it again, up to
    the lost holders' cap (9): a run of the chaos bench stood still 109 s."""
    d = deployment()
    d.start_worker("-Q", "turns", "-c", "2", roles=("turns",))
    s = spec([tools(call("append_line", {"text": "never"})), {"content": "never"}], tools=["append_line"])
    handle = d.client.submit(s)
    wait_for(lambda: queue_length(d.store, d.store.keys.tool_queue) == 1, timeout=20)  # no tool pool yet
    raw = json.loads(d.store.redis.hget(d.store.keys.run(handle.run_id), "spec"))
    d.store.redis.hset(d.store.keys.run(handle.run_id), "spec", json.dumps({**raw, "retired_field": 1}))
    d.start_worker("-Q", "tools", "-c", "2", roles=("tools",))
    result = handle.wait(timeout=30)
    ended = (result.status, result.exit, result.error_type)
    assert ended == (Status.failed, "error", "SpecUnreadable"), result
    assert "does not parse" in result.error
    assert not (run_dir(handle.run_id) / "effects.txt").exists()  # the tool never ran
    recoveries = [e for e in d.store.read_events(handle.run_id, "0") if e.type == "recovery"]
    assert not recoveries, recoveries  # ended by the call that found it, not by lease lapses


# -- item 4, continued: a running run whose spec stops parsing ---------------------------
def test_a_running_run_whose_spec_stops_parsing_ends_on_error(deployment, spec, model_server, holds):
    """Two runs are inside their first model call when their worker dies. Meanwhile one
    run's stored spec stops parsing (a field the rolled-back code forbids). When the leases
    lapse, that run ends on error as ``SpecUnreadable``, not paused or retried forever, and
    the healthy run lapsed with it is still recovered."""
    d = deployment()
    first = d.start_worker("-c", "4")
    bad_spec = spec([counted([{"content": "lost", "hold": gate(holds)}, {"content": "never"}])])
    good_spec = spec([counted([{"content": "lost", "hold": gate(holds)}, {"content": "recovered"}])])
    bad = d.client.submit(bad_spec)  # submitted first: first in the lease index
    healthy = d.client.submit(good_spec)
    wait_for(lambda: model_server.calls(bad_spec["model"]) and model_server.calls(good_spec["model"]),
             timeout=30)  # fmt: skip
    assert d.store.status(bad.run_id) == Status.running
    raw = json.loads(d.store.redis.hget(d.store.keys.run(bad.run_id), "spec"))
    d.store.redis.hset(d.store.keys.run(bad.run_id), "spec", json.dumps({**raw, "retired_field": 1}))
    d.start_worker("-c", "4")  # the one left to sweep
    first.kill()  # both turns' holders are gone: their leases lapse
    killed_at = time.monotonic()
    result = bad.wait(timeout=40)
    ended = (result.status, result.exit, result.error_type)
    assert ended == (Status.failed, "error", "SpecUnreadable"), result
    assert "does not parse" in result.error
    assert len(model_server.calls(bad_spec["model"])) == 1  # never called again on a bad spec
    assert healthy.wait(timeout=40).content == "recovered"
    assert time.monotonic() - killed_at < 6 + 15  # within TOOLOOP_RECOVERY_S, plus slack


# -- a tool worker without TOOLOOP_SECRET_KEY (issue 22, item 6) ------------------------------
def test_a_tool_worker_without_the_secret_key_fails_sealed_calls_at_once(
    deployment, spec, monkeypatch, capsys
):
    """Arguments holding a secret travel sealed; a tool worker without the key cannot open
    them. Before, the error was raised outside the call's handling: the call was sent again
    as lost until its attempts were spent and the run ended on a misleading "worker lost".
    Now the call is recorded failed with the SecretError at once (the gated one too, without
    asking a person), the model is told, and doctor names the worker that lacks the key."""
    from orchestrator.doctor import NO_KEY, diagnose, render

    d = deployment(TOOLOOP_RECOVERY_S="3")  # a quick sweeper: the old crash loop ended in seconds
    d.start_worker("-Q", "turns", "-c", "1", roles=("turns",))  # seals with the key
    keyless = d.start_worker("-Q", "tools", "-c", "1", roles=("tools",), env={"TOOLOOP_SECRET_KEY": ""})
    secret = "password=hunter2hunter2"
    s = spec([tools(call("append_line", {"text": secret}), call("guarded_append", {"text": secret})),
              {"content": "told"}], tools=["append_line", "guarded_append"])  # fmt: skip
    handle = d.client.submit(s)
    result = handle.wait(timeout=60)
    assert (result.status, result.content) == (Status.completed, "told"), result.error
    for record in result.tool_calls:
        assert not record.success and record.error.startswith("SecretError: "), record.error
        assert "TOOLOOP_SECRET_KEY" in record.error and "hunter2" not in record.error
    assert not (run_dir(handle.run_id) / "effects.txt").exists()  # nothing ran
    report = diagnose(d.store)
    workers = report["workers"]
    assert workers[f"tools@{keyless.name}"]["secret_key"] is False
    assert workers[f"turns@{d.workers[0].name}"]["secret_key"] is True
    monkeypatch.setenv("COLUMNS", "400")  # one line each, as on a wide terminal
    render(report)  # what `tooloop doctor` prints: the keyless worker's line, then why it matters
    lines = capsys.readouterr().out.splitlines()
    for name, keyless_here in ((f"tools@{keyless.name}", True), (f"turns@{d.workers[0].name}", False)):
        at = next(i for i, line in enumerate(lines) if line.startswith(f"worker {name}:"))
        block = lines[at + 1 : next((j for j in range(at + 1, len(lines)) if lines[j].startswith("worker ")),
                                    len(lines))]  # fmt: skip
        said = [line for line in block if "no TOOLOOP_SECRET_KEY" in line]
        assert said == ([f"  no TOOLOOP_SECRET_KEY: {NO_KEY}"] if keyless_here else []), lines


# -- issue 22 item 13: the sweeper's look into a queue of any length ---------------------------
def test_looking_for_messages_in_a_long_queue_never_blocks_redis(monkeypatch):
    """The sweeper looks for late steps' messages in their queue. It did so in one Lua
    script over the whole list: at a 100,000-message backlog Redis answered nobody for
    seconds, every round, per sweeping worker (here 2.5 s on a loaded box). Now each script
    examines a bounded slice (the newest first, where no message can slip past the cursor),
    and a round examines at most QUEUE_SCAN_MAX entries: a message deeper than that is
    taken as still waiting (looked for again later), never as lost. Redis's own SLOWLOG
    (time spent inside each command, whatever the clients' load) is the witness."""
    import redis

    from orchestrator import store as store_module
    from orchestrator.settings import Settings
    from orchestrator.store import RunStore
    from tests.conftest import free_port, start_redis

    port = free_port()
    server = start_redis(port)  # its own: the slow log is the server's, and 35 MB are written
    try:
        r = redis.Redis(port=port)
        store = RunStore(r, Settings(key_prefix="scan"))
        depth, queue = 100_000, "scan.turns"

        # the shape kombu gives a Celery message, about 330 bytes, LPUSHed as kombu publishes
        # (t-0 is the oldest, at the tail); written by a script: 100,000 round trips cost seconds
        shape = json.dumps({"body": "e" * 200, "content-encoding": "utf-8",
                            "headers": {"lang": "py", "task": "tooloop.turn", "id": "t-%d"},
                            "properties": {"delivery_tag": "tag-%d"}})  # fmt: skip
        fill = ("for i = 0, tonumber(ARGV[2]) - 1 do"
                " redis.call('LPUSH', KEYS[1], string.format(ARGV[1], i, i)) end")  # fmt: skip
        r.eval(fill, 1, queue, shape, depth)
        r.slowlog_reset()
        monkeypatch.setattr(store_module, "QUEUE_SCAN_MAX", 2 * depth)  # a look at the whole queue
        wanted = ["t-0", "t-50000", f"t-{depth - 1}", "t-gone", "t-also-gone"]
        assert store.queued(r, queue, wanted) == {"t-0", "t-50000", f"t-{depth - 1}"}
        slow = [(e["duration"], e["command"][:40]) for e in r.slowlog_get(128) if e["duration"] > 200_000]
        assert slow == [], slow  # no command inside Redis took 200 ms (the old script: seconds)
        # a round looks at most QUEUE_SCAN_MAX entries: deeper ones count as waiting, not lost
        monkeypatch.setattr(store_module, "QUEUE_SCAN_MAX", 10_000)
        capped = ["t-0", "t-gone", f"t-{depth - 5}"]  # the newest is found; the others not reached
        assert store.queued(r, queue, capped) == set(capped)
        r.delete(queue)
        assert store.queued(r, queue, ["t-0"]) == set()  # an empty queue holds nothing, at once
    finally:
        server.terminate()
        server.wait(10)
