"""The recovery bound under kills and a partition: no run stands still longer than
TOOLOOP_RECOVERY_S around a step that was lost with its worker.

A stall is what ``bench/chaos.py`` measures: for each ``recovery`` event of a run, from the
run's last progress before it to its first progress after. Here R = 16 s (leases of 3 s,
sweeps every 0.8 s: the default's proportions, with room for a loaded box's slow redo);
the bench holds the default R = 60 s the same way, at scale.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from orchestrator import Status
from tests.helpers import call, tools, wait_for

pytestmark = pytest.mark.xdist_group("recovery_bound")  # workers of its own, killed and frozen

RECOVERY_S = 16.0
TURNS = 12  # tool turns per run: each an effect (non-idempotent) or a read, then an answer


def stalls(events: list) -> list[float]:
    """Per ``recovery`` event: last progress before it -> first progress after (seconds)."""
    out = []
    for i, event in enumerate(events):
        if event.type != "recovery":
            continue
        before = [e.ts for e in events[:i] if e.type != "recovery"]
        after = [e.ts for e in events[i + 1 :] if e.type != "recovery"]
        if before and after:
            out.append((after[0] - before[-1]).total_seconds())
    return out


def effects(run_id: str) -> list[str]:
    path = Path(os.environ["TOOLOOP_SANDBOX_ROOT"], run_id, "effects.txt")
    return path.read_text().splitlines() if path.exists() else []


def fork_servers(worker) -> int:
    """The sandbox fork servers (worker/sandbox/zygote.py) running in ``worker``'s process group."""
    group, count = os.getpgid(worker.proc.pid), 0
    for entry in Path("/proc").iterdir():
        try:
            ours = entry.name.isdigit() and os.getpgid(int(entry.name)) == group
            count += ours and b"tooloop sandbox fork server" in (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
    return count


def long_run(spec) -> dict:
    steps = []
    for i in range(TURNS):
        tool_call = (call("append_then_sleep", {"text": f"effect-{i}", "seconds": 0.4}) if i % 2 == 0
                     else call("slow_lookup", {"key": f"k{i}", "seconds": 0.3}))  # fmt: skip
        steps.append(tools(tool_call, delay=0.3))
    return spec([*steps, {"content": "done"}], tools=["append_then_sleep", "slow_lookup"],
                max_iterations=TURNS + 2)  # fmt: skip


def test_no_stall_exceeds_the_bound_under_kills_and_a_partition(deployment, spec):
    """Six runs over three workers: one is killed -9, another frozen past its lease, thawed,
    then killed too; the third stays up. Every step they held is recovered, and no run stood
    still longer than R around it. Every run completes, each effect once."""
    d = deployment(TOOLOOP_RECOVERY_S=str(int(RECOVERY_S)))
    assert (d.settings.lease_s, d.settings.sweep_interval_s) == (3.0, 0.8)
    workers = d.start_workers(3, "-c", "2")
    # each tools pool starts its fork server as it starts: a replacement's first calls do
    # not wait for one (cold, they took 10-30 s on this box, and a re-sent step with them)
    wait_for(lambda: [fork_servers(w) for w in workers] == [1, 1, 1], timeout=60)
    first, second, _ = workers
    handles = [d.client.submit(long_run(spec)) for _ in range(6)]
    wait_for(lambda: all(h.status() == Status.running for h in handles), timeout=30)
    time.sleep(1.0)
    first.kill()
    second.freeze()  # a partition: it holds what it took, past its lease
    time.sleep(d.settings.lease_s + 1.5)
    second.thaw()  # it wakes up believing it holds its steps, and takes more
    time.sleep(1.5)
    second.kill()
    results = [h.wait(timeout=90) for h in handles]
    assert all((r.status, r.content) == (Status.completed, "done") for r in results), results
    for handle in handles:
        lines = effects(handle.run_id)
        assert len(lines) == len(set(lines)), f"an effect ran twice: {lines}"
    per_run = {h.run_id: stalls(list(h.events(timeout=5))) for h in handles}
    found = [s for run in per_run.values() for s in run]
    assert len(found) >= 3, f"the faults hit few steps: {per_run}"
    assert max(found) <= RECOVERY_S, f"stalls over the {RECOVERY_S:g} s bound: {per_run}"


def test_a_step_sent_again_is_taken_before_the_work_queued_meanwhile(deployment, spec):
    """On a Redis broker the sweeper puts a re-sent step's message at the end of its queue
    that workers take next: its run has stood still a lease already."""
    from worker.maintenance import Maintenance

    d = deployment(TOOLOOP_RECOVERY_S="2")  # leases of 1 s; no worker: the sweep is called here
    lost, *_ = [d.client.submit(spec([{"content": "x"}])) for _ in range(3)]
    queue = d.store.keys.broker_prefix + d.store.keys.turn_queue
    [message] = [m for m in d.store.redis.lrange(queue, 0, -1) if lost.run_id.encode() in m]
    assert d.store.redis.lindex(queue, -1) == message  # the first submitted: taken first anyway
    d.store.redis.lrem(queue, 1, message)  # lost (a broker failover, say)
    time.sleep(d.settings.lease_s + 0.3)  # past its dispatch deadline
    assert Maintenance(d.store, "test-sweeper", {}, d.client.celery).sweep() == 1
    assert d.store.redis.llen(queue) == 3
    assert f'"turn-{lost.run_id}-1-2"'.encode() in d.store.redis.lindex(queue, -1)
