"""Concurrent runs on one box: N runs x T turns against a model answering in D seconds.

One producer script submits every run, one `tooloop worker` (defaults: 128 turn
threads, prefork tool pool) serves them. Ideal: T x D seconds, if model calls
overlap by the hundred. Reported: elapsed / ideal (target <= 1.25).

    python bench/concurrency.py [--runs 100] [--turns 3] [--delay 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, publish, scripted_spec


def steps(turns: int, delay: float) -> list[dict]:
    call = {"delay": delay, "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}
    return [call] * (turns - 1) + [{"delay": delay, "content": "done"}]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--delay", type=float, default=5.0)
    args = parser.parse_args()
    with ExitStack() as stack:
        env = environment(stack, "examples.tools")
        from orchestrator import Client
        from orchestrator.local import WorkerProcess
        from orchestrator.scripted_model import ScriptedModel

        model_server = ScriptedModel().start()
        stack.callback(model_server.stop)
        model = model_server.script(steps(args.turns, args.delay))
        client = Client()
        worker = WorkerProcess("conc", env=env)
        stack.callback(worker.stop)
        worker.wait_ready(client.store)
        spec = scripted_spec(model_server, model, tools=["add"])
        started = time.perf_counter()
        handles = [client.submit(spec) for _ in range(args.runs)]
        submitted = time.perf_counter() - started
        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(lambda h: (h.wait(timeout=600), time.perf_counter()), handles))
        elapsed = max(done for _, done in results) - started
        per_run = [done - started for _, done in results]
        ok = sum(r.status == "completed" for r, _ in results)
    ideal = args.turns * args.delay
    lines = [
        f"{args.runs} concurrent runs x {args.turns} turns, model latency {args.delay:g} s, one worker",
        f"  submitted in            {submitted:6.2f} s (one producer script)",
        f"  completed               {ok}/{args.runs}",
        f"  all done after          {elapsed:6.2f} s   (ideal {ideal:g} s)",
        f"  median run              {statistics.median(per_run):6.2f} s",
        f"  elapsed / ideal         {elapsed / ideal:6.3f}   (target <= 1.25)",
    ]
    publish("concurrency", lines)


if __name__ == "__main__":
    main()
