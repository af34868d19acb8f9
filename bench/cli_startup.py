"""How fast the CLI answers: `tooloop status|list|pause|validate` as subprocesses.

Target: under a second. Reported against a bare `python -c pass` measured in the
same run (the interpreter's own start-up), medians of --repeat runs each.

    python bench/cli_startup.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, publish

ROOT = Path(__file__).resolve().parent.parent


def timed(argv: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run(argv, capture_output=True, cwd=ROOT, check=False)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


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
    base = rows[0][1]
    lines = [f"CLI answers, median of {args.repeat} runs (target < 1 s)"]
    lines += [f"  {name:36s} {secs:6.3f} s   {secs / base:5.1f} x python start-up" for name, secs in rows]
    publish("cli_startup", lines)


if __name__ == "__main__":
    main()
