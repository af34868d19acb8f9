"""Concurrent runs on one box: N runs x T turns against a model answering in D seconds.

One producer script submits every run at once, one `tooloop worker` with its
defaults serves them. Ideal: T x D seconds, if every model call overlaps.
Efficiency = ideal / wall, wall from the first submit to the last run's end
(``ended_at`` in the run store). Targets: >= 0.9 at 100 runs, >= 0.8 at 500.

    python bench/concurrency.py [--runs 100,500] [--turns 3] [--delay 5] [--profile]

``--profile`` records every worker process with py-spy (``--gil``: CPU, not waits)
for 15 s of the largest load, from its first submit: flame graphs in docs/bench/,
shares by suspect in docs/bench/profile_shares_concurrency.txt.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import cpu_per_turn, procs
from bench.common import REDIS_PID, environment, local_worker, publish, scripted_spec
from bench.profile_shares import summary

TARGETS = {100: 0.9, 500: 0.8}
PROFILE_S = 15


def steps(turns: int, delay: float) -> list[dict]:
    call = {"delay": delay, "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}
    return [call] * (turns - 1) + [{"delay": delay, "content": "done"}]


def one_load(client, model_server, runs: int, turns: int, delay: float, worker_pid: int,
             profile: bool = False) -> list[str]:  # fmt: skip
    spec = scripted_spec(model_server, model_server.script(steps(turns, delay)), tools=["add"])
    cpu0 = procs.cpu_of_tree(worker_pid) + (procs.cpu_of(REDIS_PID[0]) if REDIS_PID else 0.0)
    spies = cpu_per_turn.profile(worker_pid, PROFILE_S, f"conc{runs}") if profile else []
    if profile:  # this process too: the producer and the scripted model's 500 connections
        spies.append(subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "--pid",
                                       str(os.getpid()), "--duration", str(PROFILE_S), "--rate", "250",
                                       "--nonblocking", "--gil", "--format", "raw", "-o",
                                       str(cpu_per_turn.RAW / f"profile-conc{runs}-producer.txt")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
    own0 = os.times()
    started = time.time()
    handles = [client.submit(spec) for _ in range(runs)]
    submitted = time.time() - started
    results = [h.wait(timeout=900) for h in handles]
    for spy in spies:
        spy.wait()
    if spies:
        paths = sorted(cpu_per_turn.RAW.glob(f"profile-conc{runs}-*.txt"))
        publish("profile_shares_concurrency", [line for p in paths for line in summary(str(p), p.stem)])
    cpu = procs.cpu_of_tree(worker_pid) + (procs.cpu_of(REDIS_PID[0]) if REDIS_PID else 0.0) - cpu0
    own1 = os.times()
    producer = own1.user - own0.user + own1.system - own0.system  # this process: producer + model server
    store = client.store
    ended = [int(store.redis.hget(store.keys.run(h.run_id), "ended_at")) / 1000 for h in handles]
    ok = sum(r.status == "completed" for r in results)
    wall = max(ended) - started
    peak = peak_in_flight(model_server.calls(spec["model"]), delay, started)
    ideal = turns * delay
    target = f"; target >= {TARGETS[runs]}" if runs in TARGETS else ""
    median_run = statistics.median(ended) - started
    return [
        f"  {runs} runs x {turns} turns, model {delay:g} s",
        f"    submitted in        {submitted:7.2f} s (one producer script)",
        f"    completed           {ok}/{runs}",
        f"    wall                {wall:7.2f} s   (ideal {ideal:g} s; median run {median_run:.2f} s)",
        f"    efficiency          {ideal / wall:7.3f}   (ideal / wall{target})",
        f"    model calls in flight, peak  {peak}   (of {runs}: how many calls overlapped)",
        f"    CPU, all processes  {cpu / (runs * turns) * 1000:7.2f} ms per turn, "
        f"{cpu / wall:.2f} of {os.cpu_count()} cores busy on average",
        f"    CPU, this producer and the scripted model  {producer / wall:.2f} cores on average",
        *waves(model_server.calls(spec["model"]), started, delay),
    ]  # fmt: skip


def waves(requests: list[dict], since: float, delay: float) -> list[str]:
    """When each turn's model requests arrived, from the first submit: ideally all of
    turn k at (k - 1) x delay; the spread is the submits (turn 1) or the turns and tool
    calls the workers had to get through after the previous wave of replies."""
    by_turn: dict[int, list[float]] = {}
    for r in requests:
        if r["_received"] >= since:
            turn = 1 + sum(1 for m in r.get("messages", []) if m.get("role") == "assistant")
            by_turn.setdefault(turn, []).append(r["_received"] - since)
    return [f"    model requests of turn {k}: +{min(t):.2f} s to +{max(t):.2f} s (median "
            f"+{statistics.median(t):.2f}; ideal +{(k - 1) * delay:g})" for k, t in sorted(by_turn.items())]


def peak_in_flight(requests: list[dict], delay: float, since: float) -> int:
    """Most model calls open at once, from when the scripted model received each (each
    lasts ``delay``): a turn pool that holds a thread per call caps this at its threads."""
    edges = sorted([(r["_received"], 1) for r in requests if r["_received"] >= since]
                   + [(r["_received"] + delay, -1) for r in requests if r["_received"] >= since])  # fmt: skip
    peak = level = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", default="100,500", help="comma-separated loads, one after the other")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--delay", type=float, default=5.0)
    parser.add_argument("--profile", action="store_true", help="py-spy the worker during the largest load")
    args = parser.parse_args()
    with ExitStack() as stack:
        env = environment(stack, "examples.tools")
        client, model_server, worker = local_worker(stack, "conc", env=env)
        lines = ["concurrent runs, one `tooloop worker` (defaults), scripted model, one run",
                 *procs.machine(client.store.redis), procs.load_average()]  # fmt: skip
        one_load(client, model_server, 4, 2, 0.1, worker.proc.pid)  # warm-up
        loads = [int(r) for r in args.runs.split(",")]
        for runs in loads:
            profile = args.profile and runs == max(loads)
            lines += one_load(client, model_server, runs, args.turns, args.delay, worker.proc.pid, profile)
    publish("concurrency", lines)


if __name__ == "__main__":
    main()
