"""``tooloop worker``: one Celery worker per pool, supervised as a unit.

Model calls are slow I/O: turns run on a threads pool with many slots (100+
calls in flight per process). Tool calls fork sandboxed children and need a
process they can kill: tools run on a prefork pool. One Celery worker has one
pool, so serving both queues means two Celery workers, started and stopped
together; if either exits, the other is stopped and the launcher exits with
its code, so a process supervisor restarts the pair.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from orchestrator.keys import Keys

TURN_CONCURRENCY = 128
TOOL_CONCURRENCY = max(4, 2 * (os.cpu_count() or 1))


@dataclass
class PoolPlan:
    role: str  # "turns" | "tools"
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
        plans.append(PoolPlan("turns", keys.turn_queue, "threads", concurrency or TURN_CONCURRENCY))
    if "tools" in wanted:
        plans.append(PoolPlan("tools", keys.tool_queue, "prefork", concurrency or TOOL_CONCURRENCY))
    return plans


def run(plans: list[PoolPlan], name: str, loglevel: str, tools: str | None) -> int:
    env = dict(os.environ)
    if tools:
        env["TOOLOOP_TOOLS"] = ",".join(filter(None, [env.get("TOOLOOP_TOOLS"), tools]))
    children = [subprocess.Popen(p.command(name, loglevel), env=env) for p in plans]

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    while all(child.poll() is None for child in children):
        time.sleep(0.2)
    code = next(c.returncode for c in children if c.returncode is not None)
    forward(signal.SIGTERM, None)
    for child in children:
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
    return code
