"""Concurrent runs on one box: N runs x T turns against a model answering in D seconds.

One producer script submits every run at once, one `tooloop worker` with its
defaults serves them. Ideal: T x D seconds, if every model call overlaps.
Efficiency = ideal / wall, wall from the first submit to the last run's end
(``ended_at`` in the run store). Targets: >= 0.9 at 100 runs, >= 0.8 at 500.

    python bench/concurrency.py [--runs 100,500] [--turns 3] [--delay 5] [--profile] [--json FILE]

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
import threading
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import cpu_per_turn, procs
from bench.common import REDIS_PID, environment, json_option, local_worker, publish, scripted_spec, write_json
from bench.profile_shares import summary

TARGETS = {100: 0.9, 500: 0.8}
PROFILE_S = 15


def steps(turns: int, delay: float) -> list[dict]:
    call = {"delay": delay, "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}
    return [call] * (turns - 1) + [{"delay": delay, "content": "done"}]


def one_load(client, model_server, runs: int, turns: int, delay: float, worker_pid: int,
             profile: bool = False) -> tuple[list[str], dict]:  # fmt: skip
    """The load's report lines and its figures (for --json)."""
    spec = scripted_spec(model_server, model_server.script(steps(turns, delay)), tools=["add"])
    cpu0 = procs.cpu_of_tree(worker_pid) + (procs.cpu_of(REDIS_PID[0]) if REDIS_PID else 0.0)
    roles0 = roles(worker_pid)
    timeline = Timeline(worker_pid)
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
    timeline.stop()
    by_role = {k: v - roles0.get(k, 0.0) for k, v in roles(worker_pid).items()}
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
    figures = {"efficiency": ideal / wall, "wall_s": wall, "completed": ok, "runs": runs, "turns": turns,
               "delay_s": delay, "cpu_ms_per_turn": cpu / (runs * turns) * 1000}  # fmt: skip
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
        "    CPU by part, ms per turn: " + ", ".join(f"{k} {v / (runs * turns) * 1000:.2f}"
                                                  for k, v in by_role.items()),
        *waves(model_server.calls(spec["model"]), started, delay),
        *timeline.lines(started),
    ], figures  # fmt: skip


def roles(worker_pid: int) -> dict[str, float]:
    """CPU so far (s) by part of the worker: the turn processes, the tools pool's Celery
    parent, its pool processes, their fork servers with every call process (live, or reaped
    by a server), and Redis."""
    out = dict.fromkeys(("turns", "tools parent", "tools pool", "sandbox", "redis", "launcher"), 0.0)
    everything = procs.tree(worker_pid)
    kids: dict[int, list[procs.Proc]] = {}
    for p in everything:
        kids.setdefault(p.ppid, []).append(p)
    for top in kids.get(worker_pid, []):
        if " -n turns" in top.cmdline:
            out["turns"] += procs.cpu_of_tree(top.pid)
            continue
        out["tools parent"] += top.cpu_s + top.reaped_s
        for pool in kids.get(top.pid, []):
            out["tools pool"] += pool.cpu_s
            out["sandbox"] += procs.cpu_of_tree(pool.pid) - pool.cpu_s
    launcher = procs.read(worker_pid)
    out["launcher"] = launcher.cpu_s if launcher else 0.0
    out["redis"] = procs.cpu_of(REDIS_PID[0]) if REDIS_PID else 0.0
    return out


class Timeline:
    """Every 0.5 s: the CPU of the worker and Redis, and of the whole machine (/proc/stat), so
    the waves show whether the box was busy and with whose work."""

    STEP_S = 0.5

    def __init__(self, worker_pid: int) -> None:
        self.worker_pid, self.samples = worker_pid, []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            ours = procs.cpu_of_tree(self.worker_pid) + (procs.cpu_of(REDIS_PID[0]) if REDIS_PID else 0.0)
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
            busy = (sum(fields) - fields[3] - fields[4]) / procs.TICK  # all but idle and iowait
            self.samples.append((time.time(), ours, busy))
            self.done.wait(self.STEP_S)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def lines(self, since: float, step: float = 1.0) -> list[str]:
        """Per ``step`` s from the first submit: cores ours (worker + Redis) / cores busy in all."""
        out, row = [], []
        marks = [s for s in self.samples if s[0] >= since]
        t_next = since + step
        last = marks[0] if marks else None
        for s in marks[1:]:
            if s[0] >= t_next:
                dt = s[0] - last[0]
                row.append(f"{(s[1] - last[1]) / dt:.1f}/{(s[2] - last[2]) / dt:.1f}")
                last, t_next = s, t_next + step
        for i in range(0, len(row), 10):
            span = f"{i:>2}-{min(i + 10, len(row)):>2}"
            out.append(f"    cores ours/all, s {span}: " + " ".join(row[i : i + 10]))
        return out


def waves(requests: list[dict], since: float, delay: float) -> list[str]:
    """When each turn's model requests arrived, from the first submit: ideally all of
    turn k at (k - 1) x delay; the spread is the submits (turn 1) or the turns and tool
    calls the workers had to get through after the previous wave of replies."""
    by_turn: dict[int, list[float]] = {}
    for r in requests:
        if r["_received"] >= since:
            turn = 1 + sum(1 for m in r.get("messages", []) if m.get("role") == "assistant")
            by_turn.setdefault(turn, []).append(r["_received"] - since)
    return [
        f"    model requests of turn {k}: +{min(t):.2f} s to +{max(t):.2f} s (median "
        f"+{statistics.median(t):.2f}; ideal +{(k - 1) * delay:g})"
        for k, t in sorted(by_turn.items())
    ]


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
    json_option(parser)
    args = parser.parse_args()
    figures: dict[str, dict] = {}
    with ExitStack() as stack:
        env = environment(stack, "examples.tools")
        client, model_server, worker = local_worker(stack, "conc", env=env)
        lines = ["concurrent runs, one `tooloop worker` (defaults), scripted model, one run",
                 *procs.machine(client.store.redis), procs.load_average()]  # fmt: skip
        one_load(client, model_server, 4, 2, 0.1, worker.proc.pid)  # warm-up
        loads = [int(r) for r in args.runs.split(",")]
        for runs in loads:
            profile = args.profile and runs == max(loads)
            load_lines, figures[str(runs)] = one_load(client, model_server, runs, args.turns, args.delay,
                                                      worker.proc.pid, profile)  # fmt: skip
            lines += load_lines
    publish("concurrency", lines)
    write_json(args.json, {"loads": figures})


if __name__ == "__main__":
    main()
