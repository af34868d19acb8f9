"""CPU per turn on one box: every worker process, their children and Redis, per turn.

One ``tooloop worker`` with its defaults serves runs submitted by one producer
script (this one) against the scripted model answering at once, tool ``add``:

  plain   N runs of one turn answering at once (no tool): CPU / N per plain turn;
  tools   N runs x T tool-turns, then a final answer: (CPU - N x plain) / (N x T)
          per tool-turn; all-in CPU / (N x T) is printed too. With all N runs
          submitted at once the box is CPU-bound: N x T / wall is the saturation
          throughput in tool-turns/s;
  long    L runs x 100 tool-turns (ended by max_iterations; the history is compacted
          past 50 messages, as in production): Redis CPU per tool-turn as a run grows.

CPU is user + sys from /proc: the ``tooloop worker`` tree (launcher, Celery
workers, pool children, reaped sandbox forks) and a private redis-server (its CPU
is ours alone). Also printed: Redis memory per finished run, RSS per turn and per
tool process. ``--profile`` records each worker process with py-spy during the
tools phase (flame graphs and collapsed stacks in docs/bench/).

Then the plain and tools phases again on a worker whose calls fork from its pool
processes (the fork server off, as before it): the ratio, measured in the same run.

    python bench/cpu_per_turn.py [--runs 40] [--turns 10] [--long-runs 4] [--profile] [--no-compare-fork]
                                 [--json FILE]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import procs
from bench.common import (
    REDIS_PID,
    ROOT,
    environment,
    json_option,
    local_worker,
    publish,
    scripted_spec,
    write_json,
)

LONG_TURNS = 100


@dataclass
class Phase:
    turns: int  # model turns in all (tool-turns + final answers)
    tool_turns: int
    wall_s: float
    worker_cpu_s: float
    redis_cpu_s: float
    by_role: dict[str, float] = field(default_factory=dict)  # CPU s per pool (turns, tools, ...)
    redis_usec: dict[str, float] = field(default_factory=dict)  # Redis time per command

    @property
    def cpu_s(self) -> float:
        return self.worker_cpu_s + self.redis_cpu_s


def steps(turns: int) -> list[dict]:
    call = {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]}
    return [call] * turns + [{"content": "done"}]


class Bench:
    def __init__(self, client, model_server, worker_pid: int) -> None:
        self.client, self.model_server, self.worker_pid = client, model_server, worker_pid
        self.redis_pid = REDIS_PID[0] if REDIS_PID else None
        self.finished: list[str] = []

    def cpu(self) -> tuple[float, float]:
        redis_cpu = procs.cpu_of(self.redis_pid) if self.redis_pid else 0.0
        return procs.cpu_of_tree(self.worker_pid), redis_cpu

    def roles(self) -> dict[str, float]:
        """CPU so far of each pool's subtree (its Celery worker, pool children, reaped forks)."""
        out: dict[str, float] = {}
        everything = procs.tree(self.worker_pid)
        for top in everything:
            if top.ppid != self.worker_pid:
                continue
            role = top.cmdline.split(" -n ")[1].split("@")[0].split(".")[0] if " -n " in top.cmdline else "?"
            out[role] = out.get(role, 0.0) + procs.cpu_of_tree(top.pid)
        launcher = procs.read(self.worker_pid)
        out["launcher"] = launcher.cpu_s if launcher else 0.0
        return out

    def commandstats(self) -> dict[str, float]:
        stats = self.client.store.redis.info("commandstats")
        return {name.removeprefix("cmdstat_"): float(v["usec"]) for name, v in stats.items()}

    def phase(self, runs: int, tool_turns: int, long: bool = False) -> Phase:
        """``long``: the model calls tools for ever and ``max_iterations`` ends the run (its
        history is compacted on the way: the scripted model could not count turns itself)."""
        model = self.model_server.script([steps(1)[0]] if long else steps(tool_turns))
        spec = scripted_spec(self.model_server, model, tools=["add"],
                             max_iterations=tool_turns if long else tool_turns + 1)  # fmt: skip
        worker0, redis0 = self.cpu()
        roles0, usec0 = self.roles(), self.commandstats()
        started = time.perf_counter()
        handles = [self.client.submit(spec) for _ in range(runs)]
        for handle in handles:
            result = handle.wait(timeout=600)
            ended = result.exit == "max_iterations" if long else result.status == "completed"
            assert ended and len(result.tool_calls) == tool_turns, (result.status, result.error)
        wall = time.perf_counter() - started
        worker1, redis1 = self.cpu()
        roles1, usec1 = self.roles(), self.commandstats()
        self.finished = [h.run_id for h in handles]
        by_role = {k: v - roles0.get(k, 0.0) for k, v in roles1.items()}
        usec = {k: v - usec0.get(k, 0.0) for k, v in usec1.items() if v - usec0.get(k, 0.0) > 0}
        return Phase(runs * (tool_turns + 1), runs * tool_turns, wall, worker1 - worker0, redis1 - redis0,
                     by_role, usec)  # fmt: skip

    def idle_cpu_per_s(self, seconds: float = 3.0) -> float:
        worker0, redis0 = self.cpu()
        time.sleep(seconds)
        worker1, redis1 = self.cpu()
        return (worker1 - worker0 + redis1 - redis0) / seconds

    def memory_per_run(self) -> float:
        """Bytes Redis holds for one finished run (MEMORY USAGE of each of its keys)."""
        store = self.client.store
        total = 0
        for run_id in self.finished:
            for key in store.keys.all_for_run(run_id):
                total += store.redis.memory_usage(key, samples=0) or 0
        return total / max(1, len(self.finished))

    def rss(self, turn_queue: str, tool_queue: str) -> tuple[int, int, int]:
        """Largest RSS of a turn process, of a tool process (pool parent or child), and of
        a pool child's sandbox fork server."""
        turn, tool, server = 0, 0, 0
        everything = procs.tree(self.worker_pid)
        tool_parents = {p.pid for p in everything if f"-Q {tool_queue}" in p.cmdline}
        for p in everything:
            if f"-Q {turn_queue}" in p.cmdline:
                turn = max(turn, p.rss)
            elif "sandbox fork server" in p.cmdline:
                server = max(server, p.rss)
            elif p.pid in tool_parents or p.ppid in tool_parents:
                tool = max(tool, p.rss)
        return turn, tool, server


RAW = Path(tempfile.gettempdir()) / "tooloop-profiles"  # collapsed stacks: megabytes, not kept


def profile(worker_pid: int, seconds: float, tag: str) -> list[subprocess.Popen]:
    """py-spy on each Celery worker process (and its pool children) for ``seconds``, sampling
    threads that hold the GIL (CPU, not waits): flame graphs in docs/bench/, stacks in RAW."""
    spy = Path(sys.executable).with_name("py-spy")
    out = ROOT / "docs" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    RAW.mkdir(exist_ok=True)
    running = []
    for p in procs.tree(worker_pid):
        if "celery" not in p.cmdline or p.ppid != worker_pid:
            continue
        role = p.cmdline.split(" -n ")[1].split("@")[0] if " -n " in p.cmdline else str(p.pid)
        for fmt, ext in (("flamegraph", "svg"), ("raw", "txt")):
            cmd = [str(spy), "record", "--pid", str(p.pid), "--subprocesses", "--duration", str(int(seconds)),
                   "--rate", "250", "--nonblocking", "--gil", "--format", fmt,
                   "-o", str((out if ext == "svg" else RAW) / f"profile-{tag}-{role}.{ext}")]  # fmt: skip
            running.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return running


def shares_report(paths: list[Path]) -> None:
    from bench.profile_shares import summary

    publish("profile_shares", [line for path in paths for line in summary(str(path), path.stem)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--long-runs", type=int, default=4, help="runs of 100 tool-turns (0: skip)")
    parser.add_argument("--profile", action="store_true", help="py-spy the worker during the tools phase")
    parser.add_argument("--no-compare-fork", dest="compare_fork", action="store_false",
                        help="skip the same phases with calls forked from the worker (fork server off)")
    json_option(parser)
    args = parser.parse_args()
    with ExitStack() as stack:
        env = environment(stack, "examples.tools")
        client, model_server, worker = local_worker(stack, "cpu", env=env)
        bench = Bench(client, model_server, worker.proc.pid)
        head = [*procs.machine(client.store.redis), procs.load_average()]
        bench.phase(8, 3)  # warm-up: imports, connection pools, the prefork children
        idle = bench.idle_cpu_per_s()
        plain = bench.phase(args.runs, 0)
        spies = profile(worker.proc.pid, 12, "tools") if args.profile else []
        tools = bench.phase(args.runs, args.turns)
        memory = bench.memory_per_run()
        for spy in spies:
            spy.wait(timeout=60)
        if spies:
            shares_report(sorted(RAW.glob("profile-tools-*.txt")))
        long = bench.phase(args.long_runs, LONG_TURNS, long=True) if args.long_runs else None
        rss = bench.rss(client.store.keys.turn_queue, client.store.keys.tool_queue)
        worker.stop()
        forked = forks_from_the_worker(args, env, client, model_server) if args.compare_fork else None
    report(args, head, idle, plain, tools, long, memory, rss, forked)


def forks_from_the_worker(args, env: dict[str, str], client, model_server) -> tuple[Phase, Phase]:
    """The plain and tools phases again, same run, on a worker whose tool calls are forked
    from its pool processes (TOOLOOP_SANDBOX_FORK_SERVER=0), as before the fork server."""
    from orchestrator.local import WorkerProcess

    worker = WorkerProcess("cpu-forks", env={**env, "TOOLOOP_SANDBOX_FORK_SERVER": "0"})
    try:
        worker.wait_ready(client.store)
        bench = Bench(client, model_server, worker.proc.pid)
        bench.phase(8, 3)
        return bench.phase(args.runs, 0), bench.phase(args.runs, args.turns)
    finally:
        worker.stop()


def per_turn(plain: Phase, tools: Phase, runs: int) -> tuple[float, float]:
    """CPU s per plain turn, per tool-turn (a tool run's CPU less its runs' plain turns)."""
    per_plain = plain.cpu_s / runs
    return per_plain, (tools.cpu_s - runs * per_plain) / tools.tool_turns


def report(args, head: list[str], idle: float, plain: Phase, tools: Phase, long: Phase | None,
           memory: float, rss: tuple[int, int, int], forked: tuple[Phase, Phase] | None) -> None:  # fmt: skip
    n, t = args.runs, args.turns
    per_plain, per_tool = per_turn(plain, tools, n)
    redis_plain = plain.redis_cpu_s / n
    redis_tool = (tools.redis_cpu_s - n * redis_plain) / tools.tool_turns
    ms = 1000
    lines = [
        f"CPU per turn: one `tooloop worker` (defaults), {n} runs x {t} tool-turns (tool add), "
        "scripted model answering at once, one run",
        *head,
        f"  idle CPU (workers + Redis)            {idle * ms:7.1f} ms/s",
        f"  plain turn, all processes             {per_plain * ms:7.2f} ms   (target <= 10; a 1-turn run)",
        f"  tool-turn, all processes              {per_tool * ms:7.2f} ms   (target <= 15; marginal)",
        f"  tool-turn, all-in (CPU / tool-turns)  {tools.cpu_s / tools.tool_turns * ms:7.2f} ms",
        f"  Redis per tool-turn                   {redis_tool * ms:7.3f} ms   (target <= 0.5)",
        f"  Redis per plain turn                  {redis_plain * ms:7.3f} ms",
        f"  saturation                            {tools.tool_turns / tools.wall_s:7.1f} tool-turns/s "
        f"({tools.tool_turns} in {tools.wall_s:.2f} s)",
    ]
    if long is not None:
        long_redis = long.redis_cpu_s / long.tool_turns
        lines += [
            f"  Redis per tool-turn, {args.long_runs} runs x {LONG_TURNS}    {long_redis * ms:7.3f} ms   "
            f"(x{long_redis / max(redis_tool, 1e-9):.2f} of the {t}-turn figure; flat = ~1)",
            f"  all per tool-turn, {args.long_runs} runs x {LONG_TURNS}      "
            f"{long.cpu_s / long.tool_turns * ms:7.2f} ms",
        ]
    per = tools.tool_turns / ms
    lines.append("  tool phase CPU per tool-turn, by process: " + ", ".join(
        f"{role} {cpu / per:.2f} ms" for role, cpu in sorted(tools.by_role.items(), key=lambda kv: -kv[1]))
        + f", redis {tools.redis_cpu_s / per:.2f} ms")  # fmt: skip
    top = sorted(tools.redis_usec.items(), key=lambda kv: -kv[1])[:6]
    lines.append("  Redis command time per tool-turn (commandstats, all-in): " + ", ".join(
        f"{name} {usec / tools.tool_turns:.0f} us" for name, usec in top))  # fmt: skip
    if forked is not None:
        _, forked_tool = per_turn(*forked, n)
        pool, forked_pool = (p.by_role.get("tools", 0.0) / p.tool_turns for p in (tools, forked[1]))
        lines += [
            f"  tool-turn, calls forked from the worker {forked_tool * ms:5.2f} ms   (same run, "
            f"TOOLOOP_SANDBOX_FORK_SERVER=0: x{per_tool / forked_tool:.2f} with the fork server)",
            f"  tools pool, calls forked from the worker {forked_pool * ms:4.2f} ms   "
            f"(x{pool / forked_pool:.2f} with the fork server)",
        ]
    lines += [
        f"  Redis per finished {t}-turn run        {memory / 1024:7.1f} KiB   (target <= 64)",
        f"  RSS turn process / tool process       {rss[0] / 2**20:5.0f} MB / {rss[1] / 2**20:.0f} MB "
        f"(+ {rss[2] / 2**20:.0f} MB: its sandbox fork server)",
    ]
    publish("cpu_per_turn", lines)
    figures = {
        "plain_ms": per_plain * ms,
        "tool_ms": per_tool * ms,
        "tool_all_in_ms": tools.cpu_s / tools.tool_turns * ms,
        "redis_tool_ms": redis_tool * ms,
        "saturation": tools.tool_turns / tools.wall_s,
    }
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
