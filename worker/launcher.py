"""``tooloop worker``: one Celery worker per pool, supervised as a unit.

Model calls are slow I/O: turns run on threads pools with many slots (128 calls
in flight by default), spread over up to one process per core because litellm
spends ~5 ms of CPU per call under one GIL. Tool calls fork sandboxed children and need a
process they can kill: tools run on a prefork pool. One Celery worker has one
pool, so serving both queues means two Celery workers, started and stopped
together. A pool that exits unexpectedly is restarted (its in-flight steps are
recovered by the lease sweeper); a pool crash-looping more than MAX_RESTARTS
times a minute stops the pair, and the launcher exits non-zero so a process
supervisor (systemd, compose, Kubernetes) can take over.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from orchestrator.keys import Keys

TURN_CONCURRENCY = 128  # model calls in flight per `tooloop worker`, over all turn processes
TURN_PROCESSES = max(1, min(4, os.cpu_count() or 1))
TOOL_CONCURRENCY = max(4, 2 * (os.cpu_count() or 1))


@dataclass
class PoolPlan:
    role: str  # "turns", "turns.2", ... | "tools": the node name is <role>@<name>
    queue: str
    pool: str
    concurrency: int

    def command(self, name: str, loglevel: str) -> list[str]:
        quiet = ["--quiet"] if loglevel.lower() in ("warning", "error", "critical") else []
        return [
            sys.executable, "-m", "celery", "-A", "worker.app", *quiet, "worker",
            "-Q", self.queue, "-P", self.pool, "-c", str(self.concurrency),
            "-n", f"{self.role}@{name}", "-l", loglevel, "-O", "fair",
            "--without-gossip", "--without-mingle",
        ]  # fmt: skip


def plan(keys: Keys, queues: list[str], concurrency: int | None) -> list[PoolPlan]:
    wanted = {q.strip().removeprefix(f"{keys.prefix}.") for q in queues if q.strip()}
    unknown = wanted - {"turns", "tools"}
    if unknown:
        raise ValueError(f"unknown queue(s) {sorted(unknown)}: use turns, tools or both")
    plans = []
    if "turns" in wanted:
        slots = concurrency or TURN_CONCURRENCY
        processes = min(TURN_PROCESSES, slots)
        for i in range(processes):
            role = "turns" if i == 0 else f"turns.{i + 1}"
            plans.append(PoolPlan(role, keys.turn_queue, "threads", -(-slots // processes)))
    if "tools" in wanted:
        plans.append(PoolPlan("tools", keys.tool_queue, "prefork", concurrency or TOOL_CONCURRENCY))
    return plans


MAX_RESTARTS = 5  # per RESTART_WINDOW_S, then give up and exit non-zero
RESTART_WINDOW_S = 60.0
SHUTDOWN_GRACE_S = 25.0  # SIGTERM -> warm shutdown; steps unfinished after 10 s are handed back


class PoolKeeper:
    """Keeps one Celery worker per plan alive; gives up loudly on a crash loop."""

    def __init__(self, plans: list[PoolPlan], name: str, loglevel: str, env: dict[str, str]) -> None:
        self.plans, self.name, self.loglevel, self.env = plans, name, loglevel, env
        self.children = [self._spawn(p) for p in plans]
        self.restarts: list[float] = []
        self.stopping = False

    def _spawn(self, plan: PoolPlan) -> subprocess.Popen:
        return subprocess.Popen(plan.command(self.name, self.loglevel), env=self.env)

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


def run(plans: list[PoolPlan], name: str, loglevel: str, tools: str | None) -> int:
    env = dict(os.environ)
    if tools:
        env["TOOLOOP_TOOLS"] = ",".join(filter(None, [env.get("TOOLOOP_TOOLS"), tools]))
    keeper = PoolKeeper(plans, name, loglevel, env)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, keeper.forward)
    return keeper.watch()
