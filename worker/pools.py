"""How ``tooloop worker`` starts a pool: forked from the launcher, or a fresh interpreter.

A pool is ``celery -A worker.app worker`` for one queue. Started as a fresh
interpreter it spends its first seconds importing: Celery and its CLI (~0.8 s of
CPU here), the app (~0.8 s) and, for a turn pool, litellm (~5.5 s). The launcher
imports those once (``preload``) and forks each pool from itself: a worker with
two turn processes and a tools pool starts on one litellm import instead of two,
a pool that died is back in a fraction of a second, and the pools share the
imported modules' pages.

- Only libraries and modules that read no settings at import are preloaded; the
  app itself (``worker.app`` reads the environment and may ask Redis whether it is
  a cluster) and the user's tool modules are imported by each pool, as before.
- A tools pool is forked before litellm is imported, so it does not map litellm
  (nor do the calls it forks); once the launcher holds litellm, a tools pool that
  needs restarting starts as a fresh interpreter instead.
- ``fork()`` is safe only while the launcher runs one thread (a lock held by another
  thread would stay held in the child): with a second thread alive (the metrics
  server) a pool starts as a fresh interpreter.
- ``TOOLOOP_POOL_START=exec`` turns forking off; ``fork-all`` forks a tools pool even
  from a launcher that holds litellm (the test suite's launchers come preloaded with
  it from ``orchestrator/forkserver.py``).
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Protocol

log = logging.getLogger(__name__)

# What every pool imports before it reads its queue, and what reads no setting at import.
POOL_MODULES = (
    "celery.bin.celery", "celery.apps.worker", "celery.worker.consumer", "celery.worker.strategy",
    "celery.concurrency.prefork", "celery.concurrency.thread", "kombu.transport.redis",
    "kombu.transport.pyamqp", "redis", "pydantic", "pydantic_settings",
)  # fmt: skip
# What only a turn pool imports (worker.llm.preload then quiets litellm, in the pool).
TURN_MODULES = ("litellm", "litellm.litellm_core_utils.litellm_logging")


class Pool(Protocol):
    """What the launcher needs of a pool's process (``subprocess.Popen`` has it)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


class ForkedPool:
    """A pool forked from this process: the part of ``subprocess.Popen`` the launcher uses."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid, self.args = pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def mode() -> str:
    """``fork`` (the default), ``fork-all`` or ``exec``: see the module's notes."""
    return os.environ.get("TOOLOOP_POOL_START", "fork").strip().lower()


def forking() -> bool:
    return mode() != "exec"


def preload(role: str) -> None:
    """Import what a pool of ``role`` ("tools", "turns") imports before reading its queue.
    A module that fails to import here is left to the pool, which reports it its own way."""
    for name in POOL_MODULES:
        _try_import(name)
    if role.startswith("turns"):
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # as worker/llm.py sets it
        for name in TURN_MODULES:
            _try_import(name)


def _try_import(name: str) -> None:
    try:
        importlib.import_module(name)
    except Exception:  # (e.g. an optional transport's library is missing)
        log.debug("%s not preloaded", name, exc_info=True)


def may_fork(role: str) -> bool:
    """Whether a pool of ``role`` may be forked from this process now (see the module's notes)."""
    if not forking() or threading.active_count() > 1:
        return False
    lean = not any(m in sys.modules for m in TURN_MODULES)
    return role.startswith("turns") or lean or mode() == "fork-all"


def start(role: str, command: list[str], env: dict[str, str], folder: str) -> Pool:
    """The pool's process: forked from here when that is safe, else a fresh interpreter.
    ``command`` is the fresh interpreter's (``python -m celery ...``)."""
    if may_fork(role):
        return fork(command[3:], env, folder)  # what follows `python -m celery`
    return subprocess.Popen(command, env=env)


def fork(celery_args: list[str], env: dict[str, str], folder: str) -> ForkedPool:
    """Run ``celery <celery_args>`` in a child of this process, as ``python -m celery`` run in
    ``folder`` with ``env`` would."""
    from orchestrator.forkserver import become

    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return ForkedPool(pid, celery_args)
    become("celery", celery_args, env, folder)
