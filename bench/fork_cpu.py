"""CPU per forked tool call, with the fork server and without, in one run.

In a process that has imported what a tool worker's pool process holds (so a fork from
it copies what a pool child's fork copies), ``run_call`` of the registered tool ``add``
as the tool task makes it (cleanup after the record, the next spare made by
``settle()``), rounds interleaved:

  fork server        the call's process forked by this process's fork server
                     (worker/sandbox/zygote.py);
  from the worker    TOOLOOP_SANDBOX_FORK_SERVER=0: forked by this process.

Reported per call: CPU (user + sys) of this process, of the processes it reaped, and
of the fork server with the processes it reaped; and the page faults of the whole
process tree (``perf stat`` is not needed: /proc of each).

    python bench/fork_cpu.py [--rounds 5] [--calls 100]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _stat(pid: int) -> tuple[float, float, int, int]:
    """(own CPU s, reaped children's CPU s, own minor faults, reaped children's minor faults)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    minflt, cminflt = int(fields[7]), int(fields[8])
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime) / tick, (cutime + cstime) / tick, minflt, cminflt


def _server_pid() -> int | None:
    from worker.sandbox import zygote

    server = zygote._zygotes.get(os.getpid())
    return server.pid if server else None


def measure(calls: int, server: bool, root: str) -> dict[str, float]:
    from orchestrator.models import SandboxPolicy
    from worker.registry import REGISTRY
    from worker.sandbox import SandboxContext, run_call, settle

    os.environ["TOOLOOP_SANDBOX_FORK_SERVER"] = "1" if server else "0"
    fn = REGISTRY["add"].fn
    ctx = SandboxContext(os.path.join(root, "run"), 30, SandboxPolicy(), mode="basic", sandbox_root=root,
                         defer_cleanup=True)  # fmt: skip

    def call() -> None:
        assert run_call(fn, {"a": 2, "b": 3}, ctx).output == 5
        settle()

    for _ in range(5):
        call()
    spid = _server_pid() if server else None
    before = _stat(os.getpid()), (_stat(spid) if spid else (0.0, 0.0, 0, 0))
    for _ in range(calls):
        call()
        time.sleep(0.002)  # a call's record and the next turn come between calls
    after = _stat(os.getpid()), (_stat(spid) if spid else (0.0, 0.0, 0, 0))
    (w0, s0), (w1, s1) = before, after
    ms = 1000 / calls
    return {
        "worker": (w1[0] - w0[0]) * ms,
        "its children": (w1[1] - w0[1]) * ms,
        "fork server": (s1[0] - s0[0] + s1[1] - s0[1]) * ms,
        "faults": (w1[2] - w0[2] + w1[3] - w0[3] + s1[2] - s0[2] + s1[3] - s0[3]) / calls,
    }


def main() -> None:
    from bench.common import median, write_result

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    os.environ.setdefault("TOOLOOP_SANDBOX_ROOT", tempfile.mkdtemp(prefix="tooloop-bench-"))
    import examples.tools  # noqa: F401  (the tool `add`, as the benches' workers have it)
    import worker.tool_task  # noqa: F401  (a fork copies what a tool worker's pool child holds)

    root = tempfile.mkdtemp(prefix="tooloop-bench-fork-")
    samples: dict[str, list[dict[str, float]]] = {"fork server": [], "from the worker": []}
    for _ in range(args.rounds):
        for name in samples:
            samples[name].append(measure(args.calls, name == "fork server", root))
    rows = {name: {k: median([s[k] for s in runs]) for k in runs[0]} for name, runs in samples.items()}
    total = {name: r["worker"] + r["its children"] + r["fork server"] for name, r in rows.items()}
    lines = [
        f"# python bench/fork_cpu.py --rounds {args.rounds} --calls {args.calls}",
        f"# {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}, uid {os.geteuid()}; medians of rounds",
        f"{'per call':<16} {'worker':>8} {'children':>9} {'server':>8} {'all, ms':>8} {'faults':>7}",
    ]
    for name, r in rows.items():
        lines.append(f"{name:<16} {r['worker']:>8.2f} {r['its children']:>9.2f} {r['fork server']:>8.2f} "
                     f"{total[name]:>8.2f} {r['faults']:>7.0f}")  # fmt: skip
    served, forked = rows["fork server"], rows["from the worker"]
    lines.append(f"fork server / from the worker: x{total['fork server'] / total['from the worker']:.2f} "
                 f"CPU, the worker's own x{served['worker'] / forked['worker']:.2f}")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text, end="")
    print(f"written to {write_result('fork_cpu', text)}", file=sys.stderr)


if __name__ == "__main__":
    main()
