"""Per-call overhead of each sandbox layer, measured in one run, rounds interleaved.

Timed, in a process that has imported the tool worker's modules (so a fork copies
what a Celery pool child's fork copies):
  in-process   ``add(2, 3)`` called directly: no sandbox at all;
  bare fork    ``os.fork()`` + ``_exit`` + ``waitpid``: the floor of any forked layer;
  fork         ``run_call`` of a default ``@tool`` (the always-layer, Landlock and seccomp),
               all included, its process forked by the fork server (worker/sandbox/zygote.py);
  fork from the worker  the same with the fork server off (TOOLOOP_SANDBOX_FORK_SERVER=0);
  fork, no kernel layers  the same without Landlock and seccomp: their cost is the difference;
  fork, runs hidden  the Landlock rules of a worker that is not root (the folders of all
               runs unreadable: a rule per entry beside them);
  fork, hot path  the same as a tool worker runs it: a spare process forked after the
               previous call (untimed, as it happens after the record), cleanup deferred;
               with the fork server, and from the worker;
  exec         ``run_call`` of a strict tool, TOOLOOP_SANDBOX=basic (fresh interpreter);
  exec, no kernel layers  the same without Landlock and seccomp;
  bwrap        ``run_call`` of a strict tool in bubblewrap;
  bwrap shell  the ``shell`` built-in running ``true`` in bubblewrap.
Reported: median per call (ms) and the ratio to the fork layer.

    python bench/sandbox_overhead.py [--rounds 5] [--calls 40]
"""

# Imports stay inside functions: strict layers import this module afresh in the
# sandbox to find ``add``, and that import is part of what is measured.
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def bare_fork() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def layer_calls(root: str) -> dict[str, Callable[[], Any]]:
    import uuid

    from bench.sandbox_overhead import add  # importable by name, unlike __main__.add
    from orchestrator.models import SandboxPolicy
    from worker import builtins, sandbox
    from worker.sandbox import SandboxContext, run_call

    run = os.path.join(root, f"run-{uuid.uuid4().hex[:8]}")
    policy = SandboxPolicy()

    def ctx(strict: bool, mode: str) -> SandboxContext:
        return SandboxContext(run, 30, policy, strict=strict, mode=mode, sandbox_root=root)

    def sandboxed(fn: Callable[..., Any], kwargs: dict[str, Any], strict: bool, mode: str) -> Any:
        outcome = run_call(fn, kwargs, ctx(strict, mode))
        assert outcome.ok, outcome.error
        return outcome.output

    fork = lambda: sandboxed(add, {"a": 2, "b": 3}, False, "basic")  # noqa: E731
    exec_ = lambda: sandboxed(add, {"a": 2, "b": 3}, True, "basic")  # noqa: E731
    bare = {"_confinement": lambda *a, **k: sandbox.kernel.Confinement()}  # no Landlock, no seccomp
    calls: dict[str, Callable[[], Any]] = {
        "in-process": lambda: sandbox.jsonable(add(2, 3)),
        "bare fork": bare_fork,
        "fork": fork,
        "fork from the worker": from_worker(fork),
        "fork, no kernel layers": patched(fork, bare),
        "fork, runs hidden": patched(fork, {"_hides_runs": lambda uid, layer: True}),
        "exec": exec_,
        "exec, no kernel layers": patched(exec_, bare),
    }
    if sandbox.layers("auto")["bwrap"]:
        calls["bwrap"] = lambda: sandboxed(add, {"a": 2, "b": 3}, True, "bwrap")
        shell = {"command": "true", "sandbox_root": run}
        calls["bwrap shell"] = lambda: sandboxed(builtins.shell, shell, True, "bwrap")
    return calls


def patched(fn: Callable[[], Any], names: dict[str, Any]) -> Callable[[], Any]:
    """``fn`` with functions of ``worker.sandbox.plan`` replaced while it runs."""
    from worker.sandbox import plan

    def call() -> Any:
        saved = {name: getattr(plan, name) for name in names}
        for name, value in names.items():
            setattr(plan, name, value)
        try:
            return fn()
        finally:
            for name, value in saved.items():
                setattr(plan, name, value)

    return call


def from_worker(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with the fork server off: the call's process is forked from this process."""

    def call(*args: Any) -> Any:
        os.environ["TOOLOOP_SANDBOX_FORK_SERVER"] = "0"
        try:
            return fn(*args)
        finally:
            del os.environ["TOOLOOP_SANDBOX_FORK_SERVER"]

    return call


def hot_path(root: str) -> Callable[[], float]:
    """One call as the tool task makes it: only the part before its record is timed."""
    import uuid

    from bench.sandbox_overhead import add
    from orchestrator.models import SandboxPolicy
    from worker.registry import tool
    from worker.sandbox import SandboxContext, run_call, settle

    tool(name="bench_add")(add)  # spare processes run registered tools
    ctx = SandboxContext(os.path.join(root, f"run-{uuid.uuid4().hex[:8]}"), 30, SandboxPolicy(),
                         mode="basic", sandbox_root=root, defer_cleanup=True)  # fmt: skip

    def once() -> float:
        settle()  # after the previous call's record: reap it, fork the spare
        time.sleep(0.01)  # a turn passes before the next call arrives
        started = time.perf_counter()
        assert run_call(add, {"a": 2, "b": 3}, ctx).ok
        return time.perf_counter() - started

    return once


def hot_path_ms(once: Callable[[], float], calls: int) -> float:
    once()
    return sum(once() for _ in range(calls)) / calls * 1000


def per_call_ms(fn: Callable[[], Any], calls: int) -> float:
    fn()  # warm: first fork of a layer, probes, caches
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1000


def measure(rounds: int, calls: int) -> dict[str, float]:
    import tempfile

    from bench.common import median

    root = tempfile.mkdtemp(prefix="tooloop-bench-sbx-")
    layers = layer_calls(root)
    samples: dict[str, list[float]] = {name: [] for name in layers}
    once = hot_path(root)
    hot = {"fork, hot path": once, "fork from the worker, hot path": from_worker(once)}
    samples.update({name: [] for name in hot})
    for _ in range(rounds):  # interleaved: load changes hit every layer alike
        for name, fn in layers.items():
            n = calls if name == "in-process" or name.startswith(("bare", "fork")) else max(5, calls // 4)
            samples[name].append(per_call_ms(fn, n * (100 if name == "in-process" else 1)))
        for name, fn in hot.items():
            samples[name].append(hot_path_ms(fn, calls))
    return {name: median(values) for name, values in samples.items()}


def report(results: dict[str, float], rounds: int, calls: int) -> str:
    import platform
    import resource

    from worker.sandbox import layers

    fork = results["fork"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    lines = [
        f"# python bench/sandbox_overhead.py --rounds {rounds} --calls {calls}",
        f"# {platform.platform()}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}, "
        f"uid {os.geteuid()}, process max RSS {rss} MiB",
        f"# layers on: {', '.join(k for k, on in layers('auto').items() if on)}",
        f"{'layer':<23} {'ms/call':>9} {'x fork':>8}",
    ]
    for name, ms in results.items():
        lines.append(f"{name:<23} {ms:>9.3f} {ms / fork:>8.2f}")
    return "\n".join(lines) + "\n"


def main() -> None:
    import argparse
    import tempfile

    from bench.common import write_result

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    os.environ.setdefault("TOOLOOP_SANDBOX_ROOT", tempfile.mkdtemp(prefix="tooloop-bench-"))
    import worker.tool_task  # noqa: F401  (fork copies what a tool worker's pool child holds)

    text = report(measure(args.rounds, args.calls), args.rounds, args.calls)
    print(text, end="")
    print(f"written to {write_result('sandbox_overhead', text)}", file=sys.stderr)


if __name__ == "__main__":
    main()
