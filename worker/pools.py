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

import gc
import importlib
import logging
import os
import subprocess
import sys
import threading
from typing import Protocol

from orchestrator.forkserver import Forked, become

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


class ForkedPool(Forked):
    """A pool forked from this process (its parent: ``waitpid`` tells its exit)."""

    def _exited(self) -> int | None:
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        return os.waitstatus_to_exitcode(status) if pid else None


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
    gc.collect()
    gc.freeze()  # the pools' collections never walk (and so copy) what was imported here


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
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return ForkedPool(pid, celery_args)
    become("celery", celery_args, env, folder)
