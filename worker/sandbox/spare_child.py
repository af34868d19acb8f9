"""A spare process's own side: forked (by the worker, or by its fork server) ahead of its
call, it detaches, waits for exactly one call on REQUEST_FD, then confines itself as a
fresh fork would (environment, folder, limits, uid) and serves it.

Apart from ``spare.py`` (the worker's side: when to keep a spare, handing it a call) so
that the fork server (``zygote.py``), which forks spares, and ``spare.py``, which asks it
to, do not import each other."""

from __future__ import annotations

import fcntl
import os
import pickle
import signal
from typing import Any, NoReturn

from worker.sandbox.child import (
    _confine,
    _detach,
    _enter,
    _Facts,
    _handlers,
    _limits,
    _report_failed_start,
    _serve,
)
from worker.sandbox.constants import REQUEST_FD, RESULT_FD
from worker.sandbox.env import _clearenv
from worker.sandbox.kernel import _net_fds
from worker.sandbox.libc import _PR_SET_PDEATHSIG, _libc


def fork_spare(request_r: int, result_w: int, close: tuple[int, ...]) -> int:
    """Fork a spare holding these pipe ends (``close``: this process's other descriptors
    the child must not keep); its pid."""
    fds = [int(n) for n in os.listdir("/proc/self/fd")]
    facts = _Facts(fds=fds, handlers=_handlers(os.getpid()), limits=[])
    kept = tuple(fd for (pid, _), fd in _net_fds.items() if pid == os.getpid())
    _clearenv()  # looked up once here, not in each spare (scrub)
    pid = os.fork()
    if pid == 0:  # child: never returns
        for fd in close:
            os.close(fd)
        _spare_main(facts, result_w, request_r, kept)
    return pid


def _spare_main(facts: _Facts, result_w: int, request_r: int, kept: tuple[int, ...]) -> NoReturn:
    code = 1
    parent = os.getppid()  # the worker, or its fork server: the call dies with it
    try:
        high_w, high_r = fcntl.fcntl(result_w, fcntl.F_DUPFD, 10), fcntl.fcntl(request_r, fcntl.F_DUPFD, 10)
        os.dup2(high_w, RESULT_FD)  # first: errors below are reported through it
        os.dup2(high_r, REQUEST_FD)
        for fd in {high_w, high_r, result_w, request_r} - {RESULT_FD, REQUEST_FD}:
            os.close(fd)
        _detach(facts, forked=True, keep=(REQUEST_FD, *kept))
        _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # an idle spare dies with its worker
        request = _read_request()
        if request is None:  # the worker went away (or changed its mind)
            code = 0
            return
        plan, limits, name, kwargs = request
        from worker.registry import REGISTRY

        if limits is None:  # a fork server's spare: limits on its own address space
            limits = _limits(plan.policy, nproc=os.geteuid() == 0, fork=True, room=plan.room)
        _enter(plan)
        _confine(plan, _Facts(facts.fds, [], limits), parent, drop=plan.gid is not None)
        code = _serve(plan, REGISTRY[name].fn, kwargs)
    except BaseException as exc:
        _report_failed_start(exc)
    finally:
        os._exit(code)


def _read_request() -> tuple[Any, ...] | None:
    data = b""
    while len(data) < 8 or len(data) < 8 + int.from_bytes(data[:8], "big"):
        chunk = os.read(REQUEST_FD, 1 << 16)
        if not chunk:
            return None
        data += chunk
    os.close(REQUEST_FD)
    return pickle.loads(data[8:])  # from the worker itself, through its own pipe
