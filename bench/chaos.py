"""Chaos: N runs while workers are killed -9 and restarted, and Redis restarts once.

Each run has 4 turns: a non-idempotent effect (a line in its folder), an
idempotent read, another effect, an answer; model latency 0.2-1.5 s per turn.
Every --kill-every seconds a random worker is killed -9 and a new one started;
halfway, Redis (AOF on) is restarted. At the end it counts:
  completed      runs that ended `completed`
  lost           runs not ended when the system went quiet
  duplicated     effect lines written twice (a non-idempotent call run again)
  double-billed  runs whose tokens_used != tokens of their recorded replies
and the recovery times: for each step the sweeper re-dispatched, how long its run
stalled (last progress before the loss -> first progress after the re-dispatch).

    python bench/chaos.py [--runs 100] [--workers 3] [--kill-every 4] [--recovery 60]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, publish, scripted_spec

TOKENS = 30
# from tests/tools.py: a non-idempotent effect (a line in the run's folder) and an idempotent read
EFFECT, READ = "append_then_sleep", "slow_lookup"


def steps() -> list:
    def latency(step: dict) -> object:
        return lambda _request: {**step, "delay": random.uniform(0.2, 1.5), "tokens": TOKENS}

    return [
        latency({"tool_calls": [{"name": EFFECT, "arguments": {"text": "effect-1", "seconds": 1}}]}),
        latency({"tool_calls": [{"name": READ, "arguments": {"key": "k", "seconds": 0.5}}]}),
        latency({"tool_calls": [{"name": EFFECT, "arguments": {"text": "effect-3", "seconds": 1}}]}),
        latency({"content": "done"}),
    ]  # fmt: skip


class AofRedis:
    """A redis-server of our own with AOF, so it can be restarted mid-run."""

    def __init__(self, port: int) -> None:
        self.port, self.dir = port, tempfile.mkdtemp(prefix="tooloop-chaos-redis-")
        self.url = f"redis://127.0.0.1:{port}/0"
        self.start()

    def start(self) -> None:
        from orchestrator.local import redis_answers

        self.proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind",
             "127.0.0.1", "--dir", self.dir, "--appendonly", "yes", "--appendfsync", "everysec",
             "--save", "", "--maxmemory-policy", "noeviction"], stdout=subprocess.DEVNULL)  # fmt: skip
        while not redis_answers(self.url):
            time.sleep(0.05)

    def restart(self) -> float:
        started = time.monotonic()
        self.proc.terminate()  # SIGTERM: the AOF is flushed
        self.proc.wait()
        self.start()
        return time.monotonic() - started

    def stop(self) -> None:
        self.proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--kill-every", type=float, default=4.0)
    parser.add_argument("--chaos-for", type=float, default=40.0, help="seconds of kills")
    parser.add_argument("--recovery", type=float, default=60.0, help="TOOLOOP_RECOVERY_S")
    args = parser.parse_args()
    with ExitStack() as stack:
        from orchestrator.local import WorkerProcess, free_port

        redis_server = AofRedis(free_port())
        stack.callback(redis_server.stop)
        os.environ["TOOLOOP_REDIS_URL"] = redis_server.url
        env = environment(stack, "tests.tools")
        env["TOOLOOP_RECOVERY_S"] = os.environ["TOOLOOP_RECOVERY_S"] = str(args.recovery)
        from orchestrator import Client
        from orchestrator.scripted_model import ScriptedModel

        model_server = ScriptedModel().start()
        stack.callback(model_server.stop)
        model = model_server.script(steps())
        client = Client()
        workers: list[WorkerProcess] = []

        def start_worker() -> None:
            worker = WorkerProcess(f"chaos-{len(workers)}", "-c", "16", env=env)
            workers.append(worker)
            stack.callback(worker.stop)

        for _ in range(args.workers):
            start_worker()
        for worker in workers:
            worker.wait_ready(client.store)
        spec = scripted_spec(model_server, model, tools=[EFFECT, READ])
        started = time.monotonic()
        handles = [client.submit(spec) for _ in range(args.runs)]
        kills, redis_restart = chaos(workers, start_worker, redis_server, args)
        quiet_deadline = time.monotonic() + 6 * args.recovery
        while time.monotonic() < quiet_deadline and not all(h.status().ended for h in handles):
            time.sleep(0.5)
        elapsed = time.monotonic() - started
        report(args, handles, kills, redis_restart, elapsed, client)


def chaos(workers: list, start_worker, redis_server: AofRedis, args) -> tuple[list[float], float]:
    """Kill -9 a random live worker every few seconds; restart Redis once, halfway."""
    kills: list[float] = []
    redis_restart = 0.0
    end = time.monotonic() + args.chaos_for
    halfway = time.monotonic() + args.chaos_for / 2
    while time.monotonic() < end:
        time.sleep(args.kill_every)
        live = [w for w in workers if w.proc.poll() is None]
        victim = random.choice(live)
        victim.kill()
        kills.append(time.time() * 1000)
        print(f"kill -9 {victim.name}", file=sys.stderr)
        start_worker()
        if not redis_restart and time.monotonic() >= halfway:
            redis_restart = redis_server.restart()
            print(f"restarted Redis in {redis_restart:.2f}s", file=sys.stderr)
    return kills, redis_restart


def run_folder(run_id: str) -> Path:
    return Path(os.environ["TOOLOOP_SANDBOX_ROOT"], run_id)


def recovery_times(events: list[dict]) -> list[float]:
    """For each step the sweeper re-dispatched: the run's stall, from its last progress
    before the loss (no later than the kill) to its first progress after the re-dispatch.
    An upper bound on recovery: it also counts the work the lost step had done."""
    out = []
    for i, event in enumerate(events):
        if event["type"] != "recovery":
            continue
        before = [int(e["ts"]) for e in events[:i] if e["type"] != "recovery"]
        after = [int(e["ts"]) for e in events[i + 1 :] if e["type"] != "recovery"]
        if before and after:
            out.append((after[0] - before[-1]) / 1000)
    return out


def report(args, handles, kills, redis_restart, elapsed, client) -> None:
    completed = lost = duplicated = double_billed = 0
    recoveries: list[float] = []
    for handle in handles:
        result = handle.result()
        completed += result.status == "completed"
        lost += not result.status.ended
        effects_file = run_folder(handle.run_id) / "effects.txt"
        lines = effects_file.read_text().splitlines() if effects_file.exists() else []
        duplicated += len(lines) - len(set(lines))
        double_billed += result.tokens_used != TOKENS * result.iterations
        recoveries += recovery_times(list(handle.events(timeout=5)))
    cuts = statistics.quantiles(recoveries, n=100, method="inclusive") if len(recoveries) > 1 else None
    lines = [
        f"chaos: {args.runs} runs, {args.workers} workers, kill -9 every {args.kill_every:g}s for "
        f"{args.chaos_for:g}s ({len(kills)} kills), Redis restarted once ({redis_restart:.2f}s down), "
        f"TOOLOOP_RECOVERY_S={args.recovery:g}",
        f"  completed       {completed}/{args.runs}",
        f"  lost            {lost}",
        f"  duplicated      {duplicated}   (non-idempotent effects executed twice)",
        f"  double-billed   {double_billed}   (runs whose tokens count a reply twice)",
        f"  recovered steps {len(recoveries)}",
    ]
    if cuts:
        lines.append(f"  stall s         p50 {cuts[49]:.1f}  p90 {cuts[89]:.1f}  p99 {cuts[98]:.1f}  "
                     f"max {max(recoveries):.1f}   (bound {args.recovery:g})")  # fmt: skip
    lines.append(f"  all ended after {elapsed:.1f}s")
    publish("chaos", lines)


if __name__ == "__main__":
    main()
