"""``tooloop worker``: one Celery worker per pool, supervised as a unit.

Model calls are slow I/O: a turn task hands its model call to the process's event
loop and frees its thread (``worker/deferred.py``), so a turn process needs few
threads (``TURN_THREADS``) but holds many unacked turn messages: ``-c`` for the
turn pools is the number of model calls in flight (1024 by default), and each
process's prefetch is sized to hold its share of them. Turns are spread over up
to one process per core because litellm spends ~5 ms of CPU per call under one GIL.
Tool calls fork sandboxed children and need a process they can kill: tools run
on a prefork pool. One Celery worker has one pool, so serving both queues means
two Celery workers, started and stopped together. A pool that exits unexpectedly
is restarted (its in-flight steps are recovered by the lease sweeper); a pool
crash-looping more than MAX_RESTARTS times a minute stops the pair, and the
launcher exits non-zero so a process supervisor (systemd, compose, Kubernetes)
can take over.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from orchestrator.keys import Keys
from worker import pools

TURN_CONCURRENCY = 1024  # model calls in flight per `tooloop worker`, over all turn processes
TURN_THREADS = 8  # per turn process: each claims and prepares turns, then hands them to the loop
TURN_PROCESSES = max(1, min(4, os.cpu_count() or 1))
TOOL_CONCURRENCY = max(4, 2 * (os.cpu_count() or 1))


@dataclass
class PoolPlan:
    role: str  # "turns", "turns.2", ... | "tools": the node name is <role>@<name>
    queue: str
    pool: str
    concurrency: int  # pool threads or processes
    prefetch: int = 1  # messages held per slot: a turn process holds its deferred turns' messages

    def command(self, name: str, loglevel: str) -> list[str]:
        quiet = ["--quiet"] if loglevel.lower() in ("warning", "error", "critical") else []
        return [
            sys.executable, "-m", "celery", "-A", "worker.app", *quiet, "worker",
            "-Q", self.queue, "-P", self.pool, "-c", str(self.concurrency),
            "--prefetch-multiplier", str(self.prefetch),
            "-n", f"{self.role}@{name}", "-l", loglevel, "-O", "fair",
            "--without-gossip", "--without-mingle",
        ]  # fmt: skip


def check_sources(mcp_servers: str, plans: list[PoolPlan]) -> None:
    """Refuse to start (``ValueError``, one line) when a tools pool would: an
    ``mcpServers`` file that cannot be used. Checked here so that no pool starts, dies
    and is restarted for it."""
    if mcp_servers and any(p.role == "tools" for p in plans):
        from worker.sources.mcp_config import load_servers

        load_servers(mcp_servers)  # McpConfigError is a ValueError


def plan(keys: Keys, queues: list[str], concurrency: int | None) -> list[PoolPlan]:
    wanted = {q.strip().removeprefix(f"{keys.prefix}.") for q in queues if q.strip()}
    unknown = wanted - {"turns", "tools"}
    if unknown:
        raise ValueError(f"unknown queue(s) {sorted(unknown)}: use turns, tools or both")
    plans = []
    if "turns" in wanted:
        plans += turn_plans(keys, concurrency or TURN_CONCURRENCY)
    if "tools" in wanted:
        plans.append(PoolPlan("tools", keys.tool_queue, "prefork", concurrency or TOOL_CONCURRENCY))
    return plans


def turn_plans(keys: Keys, in_flight: int) -> list[PoolPlan]:
    """``in_flight`` model calls over up to TURN_PROCESSES processes: each has at most
    TURN_THREADS threads and a prefetch that holds its share of unacked (deferred) turns.
    A further process starts only once the first has all its threads: a few calls in
    flight need no second copy of litellm (~4 s of CPU to import, ~250 MB)."""
    processes = min(TURN_PROCESSES, -(-in_flight // TURN_THREADS))
    share = -(-in_flight // processes)
    threads = min(TURN_THREADS, share)
    prefetch = -(-share // threads)
    return [PoolPlan("turns" if i == 0 else f"turns.{i + 1}", keys.turn_queue, "threads", threads, prefetch)
            for i in range(processes)]  # fmt: skip


MAX_RESTARTS = 5  # per RESTART_WINDOW_S, then give up and exit non-zero
RESTART_WINDOW_S = 60.0
SHUTDOWN_GRACE_S = 25.0  # SIGTERM -> warm shutdown; steps unfinished after 10 s are handed back


class PoolKeeper:
    """Keeps one Celery worker per plan alive; gives up loudly on a crash loop."""

    def __init__(self, plans: list[PoolPlan], name: str, loglevel: str, env: dict[str, str],
                 folder: str | None = None) -> None:  # fmt: skip
        self.plans, self.name, self.loglevel, self.env = plans, name, loglevel, env
        self.folder = folder or os.getcwd()
        # The tools pool first: forked before litellm is preloaded for the turn pools (worker/pools.py).
        order = sorted(range(len(plans)), key=lambda i: plans[i].role != "tools")
        started = {i: self._spawn(plans[i], preload=True) for i in order}
        self.children: list[pools.Pool] = [started[i] for i in range(len(plans))]
        self.restarts: list[float] = []
        self.stopping = False

    def _spawn(self, plan: PoolPlan, preload: bool = False) -> pools.Pool:
        if preload and pools.forking():
            pools.preload(plan.role)
        return pools.start(plan.role, plan.command(self.name, self.loglevel), self.env, self.folder)

    def forward(self, signum: int, _frame: object = None) -> None:
        self.stopping = True
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signum)

    def watch(self) -> int:
        while not self.stopping:
            time.sleep(0.2)
            for i, child in enumerate(self.children):
                if child.poll() is not None and not self.stopping:
                    if not self._may_restart():
                        print(f"tooloop worker: {self.plans[i].role} pool keeps dying "
                              f"(exit {child.returncode}); giving up", file=sys.stderr)  # fmt: skip
                        self.forward(signal.SIGTERM)
                        self._reap()
                        return child.returncode or 1
                    print(f"tooloop worker: {self.plans[i].role} pool exited "
                          f"({child.returncode}); restarting it", file=sys.stderr)  # fmt: skip
                    self.children[i] = self._spawn(self.plans[i])
        return self._reap()

    def _may_restart(self) -> bool:
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S] + [now]
        return len(self.restarts) <= MAX_RESTARTS

    def _reap(self) -> int:
        """Wait for the pools to finish their warm shutdown, then kill what is left
        (a thread blocked in a model call would otherwise hold the process forever)."""
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        codes = []
        for child in self.children:
            try:
                codes.append(child.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                child.kill()
                codes.append(child.wait())
        return next((c for c in codes if c), 0)


def pool_path(folder: str) -> list[str]:
    """The pools' sys.path: they run ``python -m celery`` in ``folder``, so it comes first
    (this process's own first entry is its script's folder, or that same folder)."""
    return [folder, *sys.path[1:]]


def findable(module: str, path: list[str]) -> bool:
    """Whether ``module`` can be imported with ``path`` as sys.path, importing nothing:
    the top-level name is looked up there, each submodule in its package's folders."""
    top, *rest = module.split(".")
    saved = sys.path[:]
    sys.path[:] = path
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path[:] = saved
    name = top
    for part in rest:
        if spec is None or spec.submodule_search_locations is None:
            return False
        name = f"{name}.{part}"
        spec = importlib.machinery.PathFinder.find_spec(name, list(spec.submodule_search_locations))
    return spec is not None


def tools_not_found(modules: list[str], folder: str) -> str | None:
    """One message for the tool modules the pools would not find, or None. Checked before
    any pool starts: each would fail on its own, with a traceback, again and again."""
    path = pool_path(folder)
    missing = [m for m in modules if not findable(m, path)]
    if not missing:
        return None
    tops = ", ".join(sorted({repr(m.split(".")[0]) for m in missing}))
    listed = "\n".join(f"    {p or '(empty: the current folder)'}" for p in path)
    return (f"tooloop worker: tool module(s) {', '.join(map(repr, missing))} (--tools / TOOLOOP_TOOLS) "
            f"not found from the folder {folder}\n  sys.path of the pools:\n{listed}\n"
            f"  fix: start the worker from the folder that holds {tops} (your project), or put that "
            f"folder on PYTHONPATH (PYTHONPATH=/path/to/project tooloop worker ...)")  # fmt: skip


def run(plans: list[PoolPlan], name: str, loglevel: str, tools: str | None,
        metrics_port: int | None = None) -> int:  # fmt: skip
    env = dict(os.environ)
    if tools:
        env["TOOLOOP_TOOLS"] = ",".join(filter(None, [env.get("TOOLOOP_TOOLS"), tools]))
    modules = [m.strip() for m in env.get("TOOLOOP_TOOLS", "").split(",") if m.strip()]
    if missing := tools_not_found(modules, os.getcwd()):
        print(missing, file=sys.stderr)
        return 2
    made = None  # a metrics folder of our own, removed on the way out
    if metrics_port is not None:  # before any pool starts: prometheus_client reads it at import
        from orchestrator import metrics

        given = env.get(metrics.MULTIPROC_ENV)
        env[metrics.MULTIPROC_ENV] = os.environ[metrics.MULTIPROC_ENV] = metrics.multiproc_dir(given)
        made = None if given else env[metrics.MULTIPROC_ENV]
    try:
        keeper = PoolKeeper(plans, name, loglevel, env)
        if metrics_port is not None:
            serve_metrics(keeper, metrics_port)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, keeper.forward)
        return keeper.watch()
    finally:
        if made:
            shutil.rmtree(made, ignore_errors=True)


def serve_metrics(keeper: PoolKeeper, port: int) -> None:
    """/metrics for every pool process; /healthz: each pool is running and registered in Redis."""
    from orchestrator import metrics
    from orchestrator.settings import get_settings
    from orchestrator.store import RunStore

    settings = get_settings()
    store = RunStore.from_settings(settings)

    def healthy() -> tuple[bool, str]:
        dead = [p.role for p, c in zip(keeper.plans, keeper.children, strict=True) if c.poll() is not None]
        if dead:
            return False, f"pool(s) not running: {', '.join(dead)}"
        try:
            live = store.live_workers()
        except Exception as exc:
            return False, f"Redis unreachable: {exc}"
        missing = [p.role for p in keeper.plans if f"{p.role}@{keeper.name}" not in live]
        return (False, f"not registered yet: {', '.join(missing)}") if missing else (True, "ok")

    metrics.serve(port, settings, healthy)


def main(argv: list[str] | None = None) -> int:
    """``tooloop worker`` (the CLI hands its process over: ``python -m worker.launcher``).
    A plan refused (an unknown queue, an unusable ``mcpServers`` file) exits 2."""
    from orchestrator.settings import get_settings

    parser = argparse.ArgumentParser(prog="tooloop worker")
    parser.add_argument("--tools")
    parser.add_argument("-Q", "--queues", default="turns,tools")
    parser.add_argument("-c", "--concurrency", type=int)
    parser.add_argument("-n", "--name")
    parser.add_argument("-l", "--loglevel", default="info")
    parser.add_argument("--metrics-port", type=int)
    args = parser.parse_args(argv)
    settings = get_settings()
    try:
        plans = plan(Keys(settings.key_prefix), args.queues.split(","), args.concurrency)
        check_sources(settings.mcp_servers, plans)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    return run(plans, args.name or socket.gethostname(), args.loglevel, args.tools, args.metrics_port)


if __name__ == "__main__":
    sys.exit(main())
