"""Turns that wait on the model hold a socket, not a thread (issue 9).

A turn task claims its turn, hands the model call and the rest of the turn to the
process's event loop and returns; its message is acked when the turn is done.
Real workers, the scripted model (held with an event, so every call stays open
while the test looks): hundreds of calls in flight in one process with few
threads; a kill -9 mid-flight loses no run and bills nothing twice; a warm
shutdown lets in-flight turns finish, or hands them back.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from orchestrator import Status
from orchestrator.keys import Keys
from tests.helpers import call, gate, tools, wait_for
from worker import launcher, maintenance

TOKENS_PER_REPLY = 30  # the scripted model's default usage


def pool_pids(name: str, role: str) -> list[int]:
    """Pids of the Celery worker serving ``role`` in the `tooloop worker` named ``name``."""
    wanted = f"{role}@{name}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            titled = argv[0].startswith(b"[celeryd: " + wanted + b":Main")  # Celery's title (setproctitle)
            if titled or (b"celery" in b" ".join(argv) and wanted in argv):  # or as started
                pids.append(int(entry.name))
    return pids


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def turn_roles(in_flight: int) -> tuple[str, ...]:
    return tuple(p.role for p in launcher.turn_plans(Keys("x"), in_flight))


def start_pair(d, in_flight: int):
    """A turns-only worker with ``in_flight`` model calls in flight, and a small tools worker."""
    tools_worker = d.start_worker("-Q", "tools", "-c", "2", roles=("tools",))
    turns = d.start_worker("-Q", "turns", "-c", str(in_flight), roles=turn_roles(in_flight))
    return turns, tools_worker


def assert_completed_once(results: list, turns: int) -> None:
    """Every run completed, each turn's reply recorded and billed once."""
    assert [r.status for r in results] == [Status.completed] * len(results)
    odd = [(r.run_id, r.iterations, r.tokens_used) for r in results
           if r.iterations != turns or r.tokens_used != TOKENS_PER_REPLY * turns]  # fmt: skip
    assert not odd, odd
    assert all(len(r.tool_calls) == turns - 1 and all(c.success for c in r.tool_calls) for r in results)


def test_hundreds_of_model_calls_in_flight_on_few_threads(deployment, spec, model_server, holds):
    """300 turns wait on the model at once in a worker of 2 turn processes x 8 threads."""
    runs = 300
    d = deployment(TOOLOOP_RECOVERY_S="120")  # nothing is lost here: no lease (30 s) may lapse, loaded
    turns, _ = start_pair(d, in_flight=runs)
    hold = gate(holds)
    s = spec([{"content": "done", "hold": hold}])
    handles = [d.client.submit(s) for _ in range(runs)]
    wait_for(lambda: len(model_server.calls(s["model"])) >= runs, timeout=60)
    roles = turn_roles(runs)
    pids = [pid for role in roles for pid in pool_pids(turns.name, role)]
    assert len(pids) == len(roles)
    threads = {pid: threads_of(pid) for pid in pids}
    # 8 pool threads, the loop, 8 blocking threads, heartbeat, maintenance, Celery's own:
    # far fewer than one per call
    assert all(n < 48 for n in threads.values()), threads
    assert all(h.status() == Status.running for h in handles[:5])
    hold.set()
    results = [h.wait(timeout=60) for h in handles]
    assert [r.content for r in results] == ["done"] * runs
    assert len(model_server.calls(s["model"])) == runs  # each turn called the model once
    assert all(r.tokens_used == TOKENS_PER_REPLY for r in results)


def held_turns(d, spec, model_server, holds, runs: int) -> tuple:
    """``runs`` runs whose first turn waits on the model in one turn worker (returned),
    with a second turn worker up to serve what comes next: (first worker, the hold,
    the spec, the handles)."""
    first, _ = start_pair(d, in_flight=64)
    hold = gate(holds)
    s = spec([tools(call("add", {"a": 1, "b": 2}), hold=hold), {"content": "three"}], tools=["add"])
    handles = [d.client.submit(s) for _ in range(runs)]
    wait_for(lambda: len(model_server.calls(s["model"])) >= runs, timeout=30)
    d.start_worker("-Q", "turns", "-c", "64", roles=turn_roles(64))
    return first, hold, s, handles


def test_kill_with_turns_in_flight_loses_no_run(deployment, spec, model_server, holds):
    """kill -9 a turn worker holding 40 model calls on its loop: its messages were not
    acked and its leases lapse; another worker finishes every run, billing each reply once."""
    runs = 40
    first, hold, _, handles = held_turns(deployment(), spec, model_server, holds, runs)
    first.kill()
    hold.set()  # the lost calls answer into closed sockets; the re-sent turns ask again
    results = [h.wait(timeout=60) for h in handles]
    assert_completed_once(results, turns=2)
    assert [r.content for r in results] == ["three"] * runs
    assert all([c.output for c in r.tool_calls] == [3] for r in results)


def test_warm_shutdown_lets_turns_in_flight_finish(deployment, spec, model_server, holds):
    """SIGTERM while 20 turns wait on the model: the worker takes no new message, the
    replies that come within the drain are recorded by it (no model call is repeated),
    and it exits by itself, well before the launcher's grace ends."""
    runs = 20
    # nothing is lost here (the replies come within the drain): no lease (30 s) may lapse, loaded
    d = deployment(TOOLOOP_RECOVERY_S="120")
    leaving, hold, s, handles = held_turns(d, spec, model_server, holds, runs)
    stopped_at = time.monotonic()
    leaving.proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    hold.set()
    assert leaving.proc.wait(timeout=launcher.SHUTDOWN_GRACE_S) == 0
    assert time.monotonic() - stopped_at < launcher.SHUTDOWN_GRACE_S - 5  # not killed by the launcher
    results = [h.wait(timeout=60) for h in handles]
    assert_completed_once(results, turns=2)
    assert len(model_server.calls(s["model"])) == 2 * runs  # no turn asked the model twice
    assert not any(e.type == "recovery" for h in handles for e in h.events(timeout=5))


def test_warm_shutdown_hands_back_turns_that_outlast_it(deployment, spec, model_server, holds):
    """SIGTERM while 20 turns wait on a model that answers only after the worker is gone:
    their leases are handed back and another worker finishes every run, billed once."""
    runs = 20
    leaving, hold, s, handles = held_turns(deployment(), spec, model_server, holds, runs)
    leaving.proc.send_signal(signal.SIGTERM)
    stopped_at = time.monotonic()
    wait_for(lambda: len(model_server.calls(s["model"])) >= 2 * runs, timeout=25)  # asked again
    assert time.monotonic() - stopped_at > maintenance.HAND_BACK_AFTER_S - 1  # not before the hand-back
    # gone with its calls still open (a reply it got would be billed: the provider charged it)
    assert leaving.proc.wait(timeout=launcher.SHUTDOWN_GRACE_S) is not None
    hold.set()
    results = [h.wait(timeout=60) for h in handles]
    assert_completed_once(results, turns=2)
    assert [r.content for r in results] == ["three"] * runs


def test_a_second_turn_process_starts_only_past_one_process_of_threads():
    """A few calls in flight share one process (one copy of litellm, ~4 s of CPU and ~250 MB
    to start); past TURN_THREADS a process per core, up to TURN_PROCESSES."""
    assert turn_roles(1) == turn_roles(launcher.TURN_THREADS) == ("turns",)
    many = turn_roles(launcher.TURN_THREADS * 8)
    assert len(many) == launcher.TURN_PROCESSES and many[:2] == ("turns", "turns.2")[: len(many)]
    plans = launcher.turn_plans(Keys("x"), 1024)
    assert sum(p.concurrency * p.prefetch for p in plans) >= 1024  # every call in flight has a place
