"""Memory of each pool, for Kubernetes requests and limits: `tooloop worker -Q turns` and
`tooloop worker -Q tools` at their default concurrency, after serving a batch of runs.

Reported per container: processes, RSS summed, and PSS summed (shared pages counted once,
as a cgroup counts them: the figure to size requests on).

    python bench/worker_rss.py [--runs 200]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, publish, scripted_model, scripted_spec


def tree(pid: int) -> list[int]:
    """The process and all its descendants."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process, in KiB."""
    rss = pss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif line.startswith("Pss:"):
                pss = int(line.split()[1])
    except OSError:
        pass
    return rss, pss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    with ExitStack() as stack:
        env = environment(stack, "examples.tools")
        from orchestrator import Client
        from orchestrator.local import WorkerProcess

        model_server = scripted_model()
        stack.callback(model_server.stop)
        call = {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}], "delay": 0.2}
        model = model_server.script([call, call, {"content": "done", "delay": 0.2}])
        client = Client()
        pools = {"turns": WorkerProcess("rss-turns", "-Q", "turns", env=env),
                 "tools": WorkerProcess("rss-tools", "-Q", "tools", env=env)}  # fmt: skip
        for role, proc in pools.items():
            stack.callback(proc.stop)
            proc.wait_ready(client.store, (role,))
        spec = scripted_spec(model_server, model, tools=["add"])
        handles = [client.submit(spec) for _ in range(args.runs)]
        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(lambda h: h.wait(timeout=600), handles))
        ok = sum(r.status == "completed" for r in results)
        lines = [f"memory after {args.runs} runs x 3 turns ({ok} completed), {os.cpu_count()} CPUs, "
                 "default concurrency"]  # fmt: skip
        for role, proc in pools.items():
            pids = tree(proc.proc.pid)
            figures = [memory_kib(p) for p in pids]
            rss, pss = sum(f[0] for f in figures), sum(f[1] for f in figures)
            largest = max(f[0] for f in figures)
            lines.append(f"  tooloop worker -Q {role:5s}  {len(pids):2d} processes  "
                         f"RSS {rss / 1024:6.0f} MiB  PSS {pss / 1024:6.0f} MiB  "
                         f"(largest process RSS {largest / 1024:.0f} MiB)")  # fmt: skip
    publish("worker_rss", lines)


if __name__ == "__main__":
    main()
