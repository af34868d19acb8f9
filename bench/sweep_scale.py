"""The sweeper at scale: 10,000 live runs in Redis, and what one sweep round costs.

No workers run: the runs are written straight into Redis and put in the state each
scenario needs, then one sweep round (every shard, as one worker's maintenance thread
does it) is timed. Scenarios, each on all N runs at once:

  idle     every turn held under a live lease: nothing is due
  lost     every turn's holder died at the same moment (a whole fleet lost): each turn
           is sent again
  backlog  every turn's message waits in its queue, past its dispatch deadline (the turn
           pool is down): each is looked for in the queue and left alone
  paused   every run paused past its pause_max_s: each is aborted

The recovery bound holds if a lost step is re-sent within TOOLOOP_RECOVERY_S of its
last heartbeat: lease (R/4) + one sweep interval (R/20) + the sweep itself, so the sweep
of the whole fleet must take well under R - R/4 - R/20 (42 s at the default R = 60 s). With
several workers the shards are swept in parallel; the figures here are for one.

    python bench/sweep_scale.py [--runs 10000] [--sweepers 1]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, publish


def make_runs(store, n: int) -> list[str]:
    from orchestrator.models import RunSpec

    spec = RunSpec(prompt="u", model="openai/none")
    ids = [f"scale-{i}" for i in range(n)]
    pipe = store.redis.pipeline(transaction=False)
    for i, run_id in enumerate(ids):
        tenant_index = store.keys.tenant_runs(spec.tenant, _shard(run_id))
        store._run("CREATE", run_id, spec.model_dump_json(), spec.tenant, '{"role": "user"}',
                   pipe=pipe, keys=(tenant_index,))  # fmt: skip
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()
    return ids


def _shard(run_id: str) -> int:
    from orchestrator.keys import shard_of

    return shard_of(run_id)


def each(store, script: str, ids: list[str], *args) -> list:
    out = []
    pipe = store.redis.pipeline(transaction=False)
    for i, run_id in enumerate(ids):
        store._run(script, run_id, *args, pipe=pipe)
        if i % 1000 == 999:
            out += pipe.execute()
    return out + pipe.execute()


def sweep_round(store, celery, sweepers: int) -> tuple[float, int]:
    """One round over every shard by ``sweepers`` threads: (seconds, steps sent)."""
    from orchestrator.recovery import Sweeper

    time.sleep(store.settings.sweep_interval_s)  # the shard locks of the last round lapse
    sent = [0] * sweepers
    started = time.perf_counter()

    def run(i: int) -> None:
        sent[i] = Sweeper(store, f"bench-{i}", celery).sweep()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(sweepers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started, sum(sent)


def queue_length(store) -> int:
    return store.redis.llen(store.keys.broker_prefix + store.keys.turn_queue)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--sweepers", type=int, default=1)
    args = parser.parse_args()
    with ExitStack() as stack:
        environment(stack, "tests.tools")
        from orchestrator.settings import Settings
        from orchestrator.store import RunStore
        from worker.app import make_app

        # Leases of 10 s: long enough to claim every run before the first lapses, short
        # enough to wait out; a sweep's cost does not depend on R.
        settings = Settings(recovery_s=20.0)
        store = RunStore.from_settings(settings)
        celery = make_app(settings)
        n = args.runs
        lines = [f"sweep: {n:,} live runs, {args.sweepers} sweeper(s), 32 shards, one round each"]

        ids = make_runs(store, n)
        owners = [f"o{i}" for i in range(n)]
        pipe = store.redis.pipeline(transaction=False)
        for i, (run_id, owner) in enumerate(zip(ids, owners, strict=True)):
            store._run("CLAIM_TURN", run_id, 1, 1, owner, pipe=pipe)
            if i % 1000 == 999:
                pipe.execute()
        pipe.execute()
        seconds, sent = sweep_round(store, celery, args.sweepers)
        lines.append(f"  idle     {seconds * 1000:8.0f} ms   sent {sent:>6}   (every turn under a live "
                     "lease)")  # fmt: skip

        time.sleep(settings.lease_s + 0.2)  # every holder is gone
        seconds, sent = sweep_round(store, celery, args.sweepers)
        per_step = seconds * 1000 / max(sent, 1)
        lines.append(f"  lost     {seconds * 1000:8.0f} ms   sent {sent:>6}   (queue now "
                     f"{queue_length(store):,}; {per_step:.2f} ms per step)")  # fmt: skip

        time.sleep(settings.lease_s + 0.2)  # the re-sent messages wait, past their deadline
        before = queue_length(store)
        seconds, sent = sweep_round(store, celery, args.sweepers)
        lines.append(f"  backlog  {seconds * 1000:8.0f} ms   sent {sent:>6}   (queue {before:,} before, "
                     f"{queue_length(store):,} after)")  # fmt: skip

        each(store, "PAUSE", ids, 1, "bench")  # pause_max_s of 1 ms
        time.sleep(0.05)
        seconds, sent = sweep_round(store, celery, args.sweepers)
        aborted = sum(1 for s in each_status(store, ids) if s == b"aborted")
        lines.append(f"  paused   {seconds * 1000:8.0f} ms   aborted {aborted:>3,}")
        default = Settings()
        budget = default.recovery_s - default.lease_s - default.sweep_interval_s
        lines.append(f"  bound: a lost step is re-sent within lease + interval + sweep; at the default "
                     f"R = 60 s the sweep may take {budget:g} s")  # fmt: skip
        publish("sweep_scale", lines)


def each_status(store, ids: list[str]) -> list:
    pipe = store.redis.pipeline(transaction=False)
    for run_id in ids:
        pipe.hget(store.keys.run(run_id), "status")
    return pipe.execute()


if __name__ == "__main__":
    main()
