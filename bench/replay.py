"""How long a recorded run takes to replay: a 20-turn run (19 tool turns, then the answer),
recorded from a real worker, replayed offline with `orchestrator.testing.replay`.

Target: a 20-turn cassette replays in under 2 s, the embedded Redis's start included. Each
replay starts its own embedded Redis, its model server and its sandbox folder, creates the
run, runs the 20 turns and 19 tool calls through the worker's turn and tool code, and stops
everything. Reported: the first replay in this process (it imports litellm: a cost a test
session pays once), then the median and spread of the next ones, with recorded and live
tools; the embedded Redis's start and stop alone; and `tooloop replay FILE` as a command (a
fresh interpreter: litellm's import included).

    python bench/replay.py [--repeat 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, environment, local_worker, publish, scripted_spec

TURNS = 20


def record_a_run(stack: ExitStack, env: dict[str, str], folder: Path) -> Path:
    """A real 20-turn run on a worker, recorded."""
    from orchestrator.replay.cassette import save
    from orchestrator.replay.record import record

    client, model_server, _ = local_worker(stack, "bench-replay", "-c", "2", env=env)
    def write(i: int) -> dict:
        return {"name": "write_file", "arguments": {"path": f"notes/{i}.txt", "content": f"{i}\n"}}

    steps = [{"tool_calls": [write(i)]} for i in range(TURNS - 1)] + [{"content": "wrote 19 notes"}]
    handle = client.submit(scripted_spec(model_server, model_server.script(steps), tools=["write_file"],
                                         max_iterations=TURNS))  # fmt: skip
    result = handle.wait(timeout=600)
    assert result.succeeded and result.iterations == TURNS, result
    path = folder / "twenty.jsonl"
    save(record(client.store, handle.run_id), path)
    return path


def timed(path: Path, tools: str) -> float:
    from orchestrator.testing import replay

    started = time.perf_counter()
    report = replay(path, tools=tools)
    took = time.perf_counter() - started
    assert report.same and report.result.iterations == TURNS, report.divergences
    return took


def embedded_start_stop(repeat: int) -> tuple[float, float]:
    from orchestrator.local import embedded_redis

    ups, downs = [], []
    for _ in range(repeat):
        started = time.perf_counter()
        with embedded_redis():
            up = time.perf_counter()
        ups.append(up - started)
        downs.append(time.perf_counter() - up)
    return statistics.median(ups), statistics.median(downs)


def command(path: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "replay", str(path)], cwd=ROOT,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="tooloop-bench-replay-") as folder:
        env = environment(stack, "")
        path = record_a_run(stack, env, Path(folder))
        size = path.stat().st_size
        load_before = os.getloadavg()[0]
        first = timed(path, "recorded")
        recorded = [timed(path, "recorded") for _ in range(args.repeat)]
        live = [timed(path, "live") for _ in range(args.repeat)]
        up, down = embedded_start_stop(args.repeat)
        cli = command(path)
        load_after = os.getloadavg()[0]

    def spread(values: list[float]) -> str:
        return f"median {statistics.median(values):.3f} s (min {min(values):.3f}, max {max(values):.3f})"

    lines = [
        f"Replay of a {TURNS}-turn cassette ({TURNS - 1} tool calls, {size:,} bytes), target < 2 s with "
        f"the embedded Redis's start; load average {load_before:.1f} -> {load_after:.1f} on "
        f"{os.cpu_count()} CPUs",
        f"  first replay in the process (imports litellm)   {first:.3f} s",
        f"  next {args.repeat}, recorded tool results             {spread(recorded)}",
        f"  next {args.repeat}, live tools (sandboxed)            {spread(live)}",
        f"  embedded Redis alone: start {up * 1000:.0f} ms, stop {down * 1000:.0f} ms (medians)",
        f"  `tooloop replay FILE` as a command (fresh interpreter, litellm's import)  {cli:.3f} s",
    ]
    publish("replay", lines)


if __name__ == "__main__":
    main()
