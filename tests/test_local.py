"""Local deployments (orchestrator/local.py): what the demo, the benches and this suite start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from tests.helpers import wait_for

PARENT = textwrap.dedent("""
    import sys, time
    from orchestrator.local import WorkerProcess
    worker = WorkerProcess(sys.argv[1], "-c", "1")
    print(worker.proc.pid, flush=True)
    time.sleep(600)
""")


def test_a_worker_stops_when_the_process_that_started_it_is_killed(deployment) -> None:
    """A test session killed by ``timeout`` (SIGKILL: no clean-up) left its workers
    consuming, reconnecting to a deleted vhost, for hours. They now stop with it."""
    d = deployment()
    name = f"{d.prefix}-orphan"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, name], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, **d.env})  # fmt: skip
    launcher = int(parent.stdout.readline())
    wait_for(lambda: f"turns@{name}" in d.store.live_workers(), timeout=90)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    wait_for(lambda: not _alive(launcher), timeout=40)  # a warm shutdown, not a kill


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False
