"""Issue 27's table in one run: a baseline commit ("before") and this checkout ("now"),
measured alternately by the same scripts on the same box.

The baseline is checked out with ``git worktree add --detach`` in a temporary folder
(removed at the end, also on failure or Ctrl-C) and this checkout's bench/ is laid over
it: one instrument (the scripts, bench/procs.py's /proc readings) measures both systems,
each running its own orchestrator/ and worker/. Each script runs as a subprocess with its
cwd and PYTHONPATH at its system's root: the venv has this checkout installed editable,
PYTHONPATH comes before it, and ``-m`` puts the cwd first in the workers. The producer's
and (in overhead.py) a turn and a tool process's import paths are checked against it.

Order: cpu_per_turn and overhead, before then now, ``--rounds`` times (the table shows
medians, the samples below it); then concurrency (100 and 500 runs), before then now,
once each. The now runs publish their docs/bench/*.txt as when run alone (the last
cpu_per_turn with its long runs and fork comparison, which follow the phases compared).

    python bench/before_after.py [--before 9be8276] [--rounds 2] [--runs 40] [--turns 10]
                                 [--overhead-rounds 5] [--loads 100,500] [--conc-turns 3] [--delay 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, publish

BASELINE = "9be8276"  # main before issue 27's work
TARGETS = {100: 0.9, 500: 0.8}  # efficiency at N runs
CLEANUP_S = 120  # a script's own clean-up after SIGINT: its worker, its redis-server


class Stopped(Exception):
    """SIGTERM: unwound like Ctrl-C, so the running script and the worktree are cleaned up."""


@dataclass
class System:
    name: str  # "before" or "now"
    root: Path
    rev: str
    samples: dict[str, list[dict]] = field(default_factory=dict)  # script -> its --json figures


@dataclass
class Row:
    label: str
    script: str
    value: Callable[[dict], float]
    target: float | None
    at_most: bool = True  # the target is an upper bound (CPU, latency), else a lower one
    digits: int = 2

    def target_text(self) -> str:
        return "" if self.target is None else f"{'<=' if self.at_most else '>='} {self.target:g}"

    def met(self, value: float) -> str:
        if self.target is None:
            return ""
        return "yes" if (value <= self.target if self.at_most else value >= self.target) else "no"


def git(*args: str, check: bool = True) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    if check and done.returncode:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


@contextmanager
def baseline(rev: str) -> Iterator[System]:
    """A detached worktree of ``rev`` with this checkout's bench/, removed on the way out."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")  # a shallow clone lacks it: say so now
    tmp = Path(tempfile.mkdtemp(prefix="tooloop-before-")).resolve()
    tree = tmp / "tree"
    try:
        git("worktree", "add", "--detach", str(tree), sha)
        shutil.copytree(ROOT / "bench", tree / "bench", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
        yield System("before", tree, sha[:7])
    finally:
        git("worktree", "remove", "--force", str(tree), check=False)
        shutil.rmtree(tmp, ignore_errors=True)
        git("worktree", "prune", check=False)


def current() -> System:
    rev = git("rev-parse", "--short=7", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return System("now", ROOT, f"{rev} + uncommitted changes" if dirty else rev)


def call(command: list[str], cwd: Path, env: dict[str, str]) -> None:
    """Run a script in its own process group; on Ctrl-C or SIGTERM it gets one SIGINT and
    time to stop its worker and its redis-server (its ExitStack) before a kill."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, process_group=0)
    try:
        code = proc.wait()
    except BaseException:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=CLEANUP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    if code:
        raise RuntimeError(f"{' '.join(command)} exited {code}")


def measure(system: System, script: str, args: list[str], out_dir: Path) -> None:
    """One run of bench/<script> on ``system``; its figures kept in ``system.samples``."""
    runs = system.samples.setdefault(script, [])
    out = out_dir / f"{system.name}-{script}-{len(runs)}.json"
    command = [sys.executable, str(system.root / "bench" / script), *args, "--json", str(out)]
    path = os.pathsep.join(filter(None, [str(system.root), os.environ.get("PYTHONPATH")]))
    print(f"== {system.name} ({system.rev}): python bench/{script} {' '.join(args)}", flush=True)
    call(command, system.root, {**os.environ, "PYTHONPATH": path})
    figures = json.loads(out.read_text())
    check_code(system, reported_paths(figures))
    runs.append(figures)


def reported_paths(figures: dict) -> list[str]:
    """The files of orchestrator/ (and worker/) as a script's producer and workers imported them."""
    return [figures["orchestrator"], *figures.get("worker_code", [])]


def check_code(system: System, paths: list[str]) -> None:
    """Every process that reported its import path ran ``system``'s code, not the editable install."""
    strays = [p for p in paths if not Path(p).resolve().is_relative_to(system.root)]
    if strays:
        raise RuntimeError(f"{system.name} ran code from outside {system.root}: {strays}")


def rows(loads: list[int], turns: int, delay: float) -> list[Row]:
    def efficiency(runs: int) -> Callable[[dict], float]:
        return lambda figures: figures["loads"][str(runs)]["efficiency"]

    return [
        Row("CPU per tool-turn, ms (all processes and Redis)", "cpu_per_turn.py", lambda f: f["tool_ms"], 15),
        Row("CPU per plain turn, ms", "cpu_per_turn.py", lambda f: f["plain_ms"], 10),
        Row("latency overhead per tool-turn, raw Celery hops", "overhead.py",
            lambda f: f["overhead_hops"], 4),
        *(Row(f"efficiency, {n} runs x {turns} turns, model {delay:g} s", "concurrency.py", efficiency(n),
              TARGETS.get(n), at_most=False, digits=3) for n in loads),
    ]  # fmt: skip


def samples(system: System, row: Row) -> list[float]:
    return [row.value(figures) for figures in system.samples.get(row.script, [])]


def sample_text(system: System, row: Row) -> str:
    runs = system.samples.get(row.script, [])
    return ", ".join(f"{row.value(f):.{row.digits}f} (load {f['load']:.1f})" for f in runs)


def code_roots(system: System) -> str:
    """The checkouts the reporting processes imported orchestrator/ and worker/ from."""
    paths = [p for runs in system.samples.values() for figures in runs for p in reported_paths(figures)]
    return ", ".join(sorted({str(Path(p).resolve().parents[1]) for p in paths}))


def table(before: System, now: System, table_rows: list[Row], head: list[str]) -> list[str]:
    width = max(len(row.label) for row in table_rows)
    lines = [*head, f"  {'figure':{width}}  {'target':>7}  {'before':>8}  {'now':>8}  met (now)"]
    for row in table_rows:
        was, is_ = statistics.median(samples(before, row)), statistics.median(samples(now, row))
        lines.append(f"  {row.label:{width}}  {row.target_text():>7}  {was:8.{row.digits}f}  "
                     f"{is_:8.{row.digits}f}  {row.met(is_)}")  # fmt: skip
    lines.append("samples in the order run (the table shows their medians), load average at each one's end:")
    for row in table_rows:
        runs = "; ".join(f"{system.name} {sample_text(system, row)}" for system in (before, now))
        lines.append(f"  {row.label}: {runs}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default=BASELINE, help="the baseline revision (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="cpu_per_turn and overhead runs per system")
    parser.add_argument("--runs", type=int, default=40, help="cpu_per_turn.py --runs")
    parser.add_argument("--turns", type=int, default=10, help="cpu_per_turn.py --turns")
    parser.add_argument("--overhead-rounds", type=int, default=5, help="overhead.py --rounds")
    parser.add_argument("--loads", default="100,500", help="concurrency.py --runs")
    parser.add_argument("--conc-turns", type=int, default=3, help="concurrency.py --turns")
    parser.add_argument("--delay", type=float, default=5.0, help="concurrency.py --delay")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _stopped)
    # Started in the background by a shell, SIGINT comes ignored, and the scripts would inherit
    # that: the SIGINT that asks them to clean up (call) must reach them.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    started, load0 = time.time(), os.getloadavg()[0]
    now = current()
    with baseline(args.before) as before, tempfile.TemporaryDirectory(prefix="tooloop-ba-") as out:
        run_all(args, before, now, Path(out))
    loads = [int(n) for n in args.loads.split(",")]
    head = header(args, before, now, started, load0)
    publish("before_after", table(before, now, rows(loads, args.conc_turns, args.delay), head))


def header(args: argparse.Namespace, before: System, now: System, started: float, load0: float) -> list[str]:
    day, hour = "%Y-%m-%d %H:%M", "%H:%M UTC"
    span = f"{time.strftime(day, time.gmtime(started))}-{time.strftime(hour, time.gmtime())}"
    load1 = os.getloadavg()[0]
    return [
        f"issue 27's table: before ({before.rev}) and now ({now.rev}), one run, alternating, {span}",
        f"  {os.cpu_count()} cores; load average {load0:.1f} at the start, {load1:.1f} at the end",
        f"  cpu_per_turn: {args.runs} runs x {args.turns} tool-turns; overhead: {args.overhead_rounds}"
        " rounds",
        f"  code imported (producers; overhead's turn and tool processes): before {code_roots(before)}"
        f" (a temporary worktree, this checkout's bench/ over it), now {code_roots(now)}",
    ]


def run_all(args: argparse.Namespace, before: System, now: System, out: Path) -> None:
    cpu = ["--runs", str(args.runs), "--turns", str(args.turns)]
    phases_only = ["--long-runs", "0", "--no-compare-fork"]  # what follows the phases compared
    for round_ in range(args.rounds):
        measure(before, "cpu_per_turn.py", cpu + phases_only, out)
        # The last now run's long runs and fork comparison stay in docs/bench/cpu_per_turn.txt.
        measure(now, "cpu_per_turn.py", cpu + ([] if round_ == args.rounds - 1 else phases_only), out)
        for system in (before, now):
            measure(system, "overhead.py", ["--rounds", str(args.overhead_rounds)], out)
    conc = ["--runs", args.loads, "--turns", str(args.conc_turns), "--delay", f"{args.delay:g}"]
    for system in (before, now):
        measure(system, "concurrency.py", conc, out)


def _stopped(signum: int, _frame: object) -> None:
    raise Stopped(f"signal {signum}")


if __name__ == "__main__":
    main()
