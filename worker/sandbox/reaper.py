"""Killing what a call leaves behind: this process is the subreaper of the calls'
orphans, finds them among its children by uid, kills and reaps them; and
``kill(-1)`` as a call's uid ends every process of that uid at once."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable

from worker.sandbox.constants import SWEEP_S, UID_BASE, UID_SPAN
from worker.sandbox.libc import _PR_SET_CHILD_SUBREAPER, _libc

log = logging.getLogger(__name__)


def _become_subreaper() -> None:
    """Orphans of a call (``setsid`` + double fork) are re-parented to us, not to init:
    we can find, kill and reap them. Not inherited over fork: once per process."""
    if _subreaper_pid[0] != os.getpid():
        _libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        _subreaper_pid[0] = os.getpid()


_subreaper_pid = [0]


def _children() -> list[int]:
    """Children of this process: the calls' processes, and orphans re-parented to it
    (the kernel hands those to the main thread while it lives; calls fork from it)."""
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _proc_uid(pid: int) -> int | None:
    return _proc_identity(pid)[1]


def _proc_identity(pid: int) -> tuple[str, int | None]:
    """(command name, real uid) of a process, from /proc/<pid>/status."""
    name, uid = "", None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Name:"):
                    name = line.split(None, 1)[1].strip()
                elif line.startswith("Uid:"):
                    uid = int(line.split()[1])
                    break
    except (OSError, ValueError, IndexError):
        pass
    return name, uid


def _is_sandbox_process(name: str, uid: int | None) -> bool:
    return name == "bwrap" or (uid is not None and UID_BASE <= uid < UID_BASE + UID_SPAN)


def _sweep(ours: Callable[[int], bool]) -> None:
    """Kill and reap the call's orphans, round after round (killing one re-parents its
    children to us), for at most SWEEP_S."""
    deadline = time.monotonic() + SWEEP_S
    while time.monotonic() < deadline:
        kids = [pid for pid in _children() if ours(pid)]
        if not kids:
            return
        for pid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in kids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.001)
    log.warning("sandbox: orphans of a tool call still alive after %.1fs", SWEEP_S)


def _reap_sandbox_zombies() -> bool:
    """Reap exited children of sandbox uids (orphans of calls, re-parented to us) without
    reading /proc: ``waitid(WNOWAIT)`` shows an exited child's uid before it is reaped.
    True when no child is left; False if some still runs (maybe a call's, killed but not
    dead yet) or is not a sandbox uid's: then sweep the slow way."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True  # the usual case in a pool process: no child at all
        if info is None or not UID_BASE <= info.si_uid < UID_BASE + UID_SPAN:
            return False
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, 0)


def _kill_uid(uid: int) -> None:
    """``kill(-1)`` as ``uid``: every process of that uid, atomically (a fork bomb cannot
    outrun it), escaped sessions included. Never as root: that would kill the host."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresuid(uid, uid, uid)
            if uid != 0 and os.getresuid() == (uid, uid, uid):
                os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
