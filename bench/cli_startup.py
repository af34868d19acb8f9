"""How fast the CLI answers: `tooloop status|list|pause|validate` as subprocesses.

Target: under a second. Reported against a bare `python -c pass` measured in the
same run (the interpreter's own start-up), medians of --repeat runs each. Wall-clock
time and the command's own CPU time (user + system): on a machine shared with other
work the wall clock includes waiting for a core, the CPU time much less so.

    python bench/cli_startup.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, publish

ROOT = Path(__file__).resolve().parent.parent


def timed(argv: list[str], repeat: int) -> tuple[float, float]:
    """Median wall-clock and median CPU seconds of the command."""
    walls, cpus = [], []
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        subprocess.run(argv, capture_output=True, cwd=ROOT, check=False)
        walls.append(time.perf_counter() - started)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    with ExitStack() as stack:
        environment(stack, "")
        from orchestrator.models import RunSpec
        from orchestrator.store import RunStore

        store = RunStore.from_settings()
        store.create("bench-run", RunSpec(prompt="p", model="openai/x"), [])
        cli = [sys.executable, "-m", "orchestrator.cli"]
        rows = [("python -c pass", timed([sys.executable, "-c", "pass"], args.repeat))]
        for command in (["status", "bench-run"], ["status", "bench-run", "--json"], ["list"],
                        ["pause", "bench-run"], ["validate", "examples/add.yaml"], ["--help"]):
            rows.append((f"tooloop {' '.join(command)}", timed(cli + command, args.repeat)))
    base = rows[0][1][0]
    load = os.getloadavg()[0]
    lines = [f"CLI answers, median of {args.repeat} runs (target < 1 s); load average {load:.1f} "
             f"on {os.cpu_count()} CPUs", f"  {'':36s} {'wall':>8s}   {'':22s} {'CPU':>8s}"]
    lines += [f"  {name:36s} {wall:6.3f} s   {wall / base:5.1f} x python start-up {cpu:6.3f} s"
              for name, (wall, cpu) in rows]  # fmt: skip
    publish("cli_startup", lines)


if __name__ == "__main__":
    main()
