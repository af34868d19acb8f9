"""kill -9 at chosen points: every run finishes on another worker, effects once, billing once.

Each test gets its own deployment (key prefix, workers) with TOOLOOP_RECOVERY_S=6
(leases of 3 s, sweeps every 0.5 s), so losses are detected within seconds.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

from orchestrator import Status
from orchestrator.broker import purge
from tests.helpers import call, gate, tools, wait_for

RECOVERY_S = 6.0


def effects(store, run_id: str) -> list[str]:
    path = Path(os.environ["TOOLOOP_SANDBOX_ROOT"], run_id, "effects.txt")
    return path.read_text().splitlines() if path.exists() else []


def assert_billed_once(result, tokens_per_reply: int = 30) -> None:
    """tokens_used counts each recorded reply once, however many calls were lost."""
    assert result.tokens_used == tokens_per_reply * result.iterations


def assert_every_reply_billed_once(result, replies_sent: int, tokens_per_reply: int = 30) -> None:
    """A reply that reached a worker after its turn was handed over is not recorded but is
    billed, once (even after the run ended): every recorded reply billed, and never more
    replies billed than the model sent."""
    billed, left = divmod(result.tokens_used, tokens_per_reply)
    assert left == 0 and result.iterations <= billed <= replies_sent, (result.tokens_used, replies_sent)


def test_kill_during_model_call(deployment, spec, model_server):
    d = deployment()
    first = d.start_worker("-c", "2")
    hold = threading.Event()
    s = spec([tools(call("add", {"a": 1, "b": 2}), hold=hold), {"content": "three"}], tools=["add"])
    handle = d.client.submit(s)
    wait_for(lambda: model_server.calls(s["model"]))  # first's turn is waiting on the model
    d.start_worker("-c", "2")
    first.kill()
    killed_at = time.monotonic()
    hold.set()  # the scripted model answers again (same step): the lost reply was never recorded
    result = handle.wait(timeout=40)
    recovered_in = time.monotonic() - killed_at
    assert (result.status, result.content) == (Status.completed, "three")
    assert recovered_in < RECOVERY_S + 10
    assert len(model_server.calls(s["model"])) == 3  # turn 1 twice (one lost), turn 2 once
    assert result.iterations == 2 and [r.output for r in result.tool_calls] == [3]
    assert_billed_once(result)


def test_kill_during_non_idempotent_tool_call(deployment, spec, model_server):
    d = deployment()
    first = d.start_worker("-c", "2")
    s = spec([tools(call("append_then_sleep", {"text": "effect-1", "seconds": 90})), {"content": "ok"}],
             tools=["append_then_sleep"])  # fmt: skip
    handle = d.client.submit(s)
    wait_for(lambda: effects(d.store, handle.run_id))  # the effect happened, the result did not
    d.start_worker("-c", "2")
    first.kill()
    result = handle.wait(timeout=40)
    assert (result.status, result.content) == (Status.completed, "ok")
    assert effects(d.store, handle.run_id) == ["effect-1"]  # not executed twice
    [record] = result.tool_calls
    assert not record.success and record.error.startswith("WorkerLost")
    assert "outcome is unknown" in record.error
    fed_back = model_server.calls(s["model"])[1]["messages"][-1]["content"]
    assert fed_back.startswith("Error: WorkerLost")
    assert_billed_once(result)


def test_kill_during_idempotent_tool_call_runs_it_again(deployment, spec):
    d = deployment()
    first = d.start_worker("-c", "2")
    s = spec([tools(call("slow_lookup", {"key": "abc", "seconds": 2})), {"content": "ok"}],
             tools=["slow_lookup"])  # fmt: skip
    handle = d.client.submit(s)
    wait_for(lambda: d.store.redis.hget(d.store.keys.call_state(handle.run_id), "1.0") or b"", timeout=15)
    wait_for(lambda: d.store.redis.hget(d.store.keys.call_state(handle.run_id), "1.0").startswith(b"s|"))
    d.start_worker("-c", "2")
    first.kill()
    result = handle.wait(timeout=40)
    [record] = result.tool_calls
    assert record.success and record.output == "ABC"
    assert_billed_once(result)


def test_lost_message_is_re_enqueued(deployment, spec, model_server):
    """A step with no live task (message lost, e.g. a Redis failover) is found by the sweeper."""
    d = deployment()
    s = spec([tools(call("add", {"a": 2, "b": 2})), {"content": "four"}], tools=["add"])
    handle = d.client.submit(s)
    assert purge(d.client.celery, d.store.keys.turn_queue) == 1  # the turn's message is gone
    d.start_worker("-c", "2")
    result = handle.wait(timeout=40)
    assert result.content == "four" and len(model_server.calls(s["model"])) == 2
    recovery = [e for e in handle.events(timeout=5) if e.type == "recovery"]
    assert [(e.step, e.iteration) for e in recovery] == [("turn", 1)]


def test_repeated_kills_during_a_long_run(deployment, spec, model_server):
    """kill -9 a worker every ~1.5 s during a 12-turn run; the other one carries on."""
    d = deployment()
    steps = [tools(call("append_then_sleep", {"text": f"turn-{i}", "seconds": 0.3}), delay=0.2)
             for i in range(12)] + [{"content": "done"}]  # fmt: skip
    a, b = d.start_worker("-c", "2"), d.start_worker("-c", "2")
    handle = d.client.submit(spec(steps, tools=["append_then_sleep"], max_iterations=20))
    for victim in (a, b, None):
        time.sleep(1.5)
        if victim is None or handle.status().ended:
            break
        victim.kill()
        d.start_worker("-c", "2")
    result = handle.wait(timeout=120)
    assert (result.status, result.content) == (Status.completed, "done")
    lines = effects(d.store, handle.run_id)
    assert len(lines) == len(set(lines)), "a non-idempotent effect happened twice"
    done = [r for r in result.tool_calls if r.success]
    assert {f"turn-{r.iteration - 1}" for r in done} <= set(lines)
    assert all(r.success or r.error.startswith("WorkerLost") for r in result.tool_calls)
    assert_billed_once(result)


def test_duplicate_deliveries_are_no_ops(client, worker, spec, model_server, store):
    """The same turn and tool messages delivered again change nothing."""
    from worker.app import enqueue_call, enqueue_turn

    app = client.celery  # this stack's broker
    s = spec([tools(call("add", {"a": 5, "b": 5})), {"content": "ten"}], tools=["add"])
    handle = client.submit(s)
    result = handle.wait(timeout=30)
    payload = {"run_id": handle.run_id, "iteration": 1, "index": 0, "key": "1.0", "call_id": "x",
               "tool": "add", "arguments": '{"a": 1, "b": 1}', "allowed": True, "timeout_s": 5}  # fmt: skip
    for gen in (1, 2, 3):  # whatever generation they carry
        enqueue_turn(handle.run_id, 1, gen, app)
        enqueue_turn(handle.run_id, 2, gen, app)
        enqueue_call(payload, gen, app)
    time.sleep(1.5)
    again = handle.result()
    assert again == result and len(model_server.calls(s["model"])) == 2


# -- Redis restarts (the aof_redis fixture is in conftest.py) ----------------------
def test_redis_restart_mid_run_loses_nothing(deployment, spec, model_server, aof_redis):
    d = deployment(TOOLOOP_REDIS_URL=aof_redis.url)
    worker = d.start_worker("-c", "2")
    steps = [tools(call("add", {"a": i, "b": 1}), delay=0.3) for i in range(6)] + [{"content": "done"}]
    handle = d.client.submit(spec(steps, tools=["add"]))
    wait_for(lambda: d.store.result(handle.run_id).iterations >= 2)
    aof_redis.restart()
    try:
        result = handle.wait(timeout=90)
    except Exception:
        raise AssertionError(f"run did not finish after a Redis restart:\n{worker.tail()}") from None
    assert (result.status, result.content) == (Status.completed, "done")
    assert [r.output for r in result.tool_calls] == [1, 2, 3, 4, 5, 6]
    assert_billed_once(result)


def test_launcher_restarts_a_pool_that_died(deployment, spec, model_server):
    """kill -9 only the turns pool: `tooloop worker` restarts it and the run finishes."""
    d = deployment()
    worker = d.start_worker("-c", "2")
    hold = threading.Event()
    s = spec([{"content": "after restart", "hold": hold}])
    handle = d.client.submit(s)
    wait_for(lambda: model_server.calls(s["model"]))
    turns = [int(p) for p in subprocess.check_output(["pgrep", "-P", str(worker.proc.pid)]).split()
             if b"turns@" in Path(f"/proc/{int(p)}/cmdline").read_bytes()]  # fmt: skip
    assert len(turns) == 1
    os.kill(turns[0], 9)
    hold.set()
    result = handle.wait(timeout=60)
    assert result.content == "after restart" and worker.proc.poll() is None
    wait_for(lambda: "turns pool exited" in worker.tail(20000), timeout=10)


def test_warm_shutdown_hands_unfinished_turns_back(deployment, spec, model_server, holds):
    """SIGTERM (a deploy, a scale-down): a turn still running after 10 s is handed back
    and resumed elsewhere well before its 25 s lease would have expired."""
    d = deployment(TOOLOOP_RECOVERY_S="100")  # leases of 25 s, sweeps every 5 s
    leaving = d.start_worker("-c", "2")
    s = spec([{"content": "handed over", "hold": gate(holds)}])
    handle = d.client.submit(s)
    wait_for(lambda: model_server.calls(s["model"]))
    d.start_worker("-c", "2")
    leaving.proc.terminate()
    started = time.monotonic()
    wait_for(lambda: len(model_server.calls(s["model"])) == 2, timeout=25)
    handed_over_in = time.monotonic() - started
    holds[0].set()
    result = handle.wait(timeout=30)
    assert result.content == "handed over" and result.iterations == 1
    assert 9 < handed_over_in < 20  # 10 s of grace, then within a sweep interval (5 s)
    assert leaving.proc.wait(timeout=30) is not None  # the launcher exits, blocked threads or not
    # the leaving worker's reply arrives too: billed if it is still there to see it (it
    # is not recorded either way)
    assert_every_reply_billed_once(handle.wait(timeout=5), len(model_server.calls(s["model"])))


def test_redis_restart_during_a_tool_call_keeps_its_result(deployment, spec, aof_redis):
    """The broker connection drops under a running tool call: the call finishes and its
    result is recorded (the task is not cancelled; its redelivery would be a no-op)."""
    d = deployment(TOOLOOP_REDIS_URL=aof_redis.url)
    d.start_worker("-c", "2")
    s = spec([tools(call("append_then_sleep", {"text": "once", "seconds": 3})), {"content": "ok"}],
             tools=["append_then_sleep"])  # fmt: skip
    handle = d.client.submit(s)
    wait_for(lambda: effects(d.store, handle.run_id))
    aof_redis.restart()
    result = handle.wait(timeout=60)
    [record] = result.tool_calls
    assert record.success and record.output == 1, record
    assert effects(d.store, handle.run_id) == ["once"]
