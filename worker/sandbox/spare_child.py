"""A spare process's own side: forked (by the worker, or by its fork server) ahead of its
call, it detaches, waits for its call on REQUEST_FD, then confines itself as a fresh fork
would (environment, folder, limits, uid) and serves it. Where the worker allows it
(``reuse.py``), it then waits for the same run's next call, as long as each call ends clean.

Apart from ``spare.py`` (the worker's side: when to keep a spare, handing it a call) so
that the fork server (``zygote.py``), which forks spares, and ``spare.py``, which asks it
to, do not import each other."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import resource
import signal
import threading
from dataclasses import dataclass
from typing import Any, NoReturn

from worker.sandbox.child import (
    _confine,
    _detach,
    _enter,
    _Facts,
    _handlers,
    _kill_own_uid,
    _limits,
    _report,
    _report_failed_start,
    _run_tool,
    _serve,
)
from worker.sandbox.constants import REQUEST_FD, RESULT_FD
from worker.sandbox.env import _clearenv, scrub
from worker.sandbox.kernel import _net_fds
from worker.sandbox.libc import _PR_SET_PDEATHSIG, _libc

_PR_SET_CHILD_SUBREAPER = 36


def fork_spare(request_r: int, result_w: int, close: tuple[int, ...] | None,
               renice: int | None = None) -> int:  # fmt: skip
    """Fork a spare holding these pipe ends; its pid. ``close``: this process's other
    descriptors the child must not keep; None (a fork server's spare): every descriptor
    above stdio is the server's (its connections, the kept processes' pipes), closed by
    range in the child, not one by one (with 500 kept processes, ~2,000 system calls and
    +3 ms per spare). ``renice``: the priority it takes back once it is given its call (a
    spare forked ahead, at a low priority, by a root fork server)."""
    fds = None if close is None else [int(n) for n in os.listdir("/proc/self/fd")]
    facts = _Facts(fds=fds, handlers=_handlers(os.getpid()), limits=[])
    kept = tuple(fd for (pid, _), fd in _net_fds.items() if pid == os.getpid())
    _clearenv()  # looked up once here, not in each spare (scrub)
    pid = os.fork()
    if pid == 0:  # child: never returns
        for fd in close or ():
            os.close(fd)
        _spare_main(facts, result_w, request_r, kept, renice)
    return pid


def _spare_main(facts: _Facts, result_w: int, request_r: int, kept: tuple[int, ...],
                renice: int | None = None) -> NoReturn:  # fmt: skip
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
        if renice is not None:  # forked ahead at a low priority: the call runs at the worker's
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, 0, renice)
        plan, limits, name, kwargs, may_stay = request
        if not may_stay:
            os.close(REQUEST_FD)
        from worker.registry import REGISTRY

        if limits is None:  # a fork server's spare: limits on its own address space
            limits = _limits(plan.policy, nproc=os.geteuid() == 0, fork=True, room=plan.room)
        _enter(plan)
        # The run's folder, held open from here (as root): a later call's process is its uid
        # already, and may not search the folders above (a 0700 home holding the runs).
        folder = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if may_stay else -1
        # Every process the calls start is its child, even once orphaned: counted before it
        # stays (reuse.py), and, while it lives, never handed to its fork server, whose
        # orphans are then only those of calls whose process has ended (fork_server.py).
        _libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        _confine(plan, _Facts(facts.fds, [], limits), parent, drop=plan.gid is not None)
        if not may_stay:
            code = _serve(plan, REGISTRY[name].fn, kwargs)
            return
        pipes = _State.now()
        while _serve_and_stay(plan, REGISTRY[name].fn, kwargs, may_stay, pipes):
            request = _read_request()
            if request is None:  # no longer kept (reuse.py), or the worker is gone
                code = 0
                return
            plan, _, name, kwargs, may_stay = request
            _again(plan, folder)
        code = 0
    except BaseException as exc:
        _report_failed_start(exc)
    finally:
        os._exit(code)


def _read_request() -> tuple[Any, ...] | None:
    """One request: the worker sends the next only after this one's result (no over-read)."""
    data = b""
    while len(data) < 8 or len(data) < 8 + int.from_bytes(data[:8], "big"):
        chunk = os.read(REQUEST_FD, 1 << 16)
        if not chunk:
            return None
        data += chunk
    return pickle.loads(data[8:])  # from the worker itself, through its own pipe


# -- serving the run's next calls (worker/sandbox/reuse.py) ----------------------------------
REUSE_CPU_S = 0.25  # CPU of the process in all, past which it serves no other call
REUSE_GROWTH_KB = 16 << 10  # peak RSS above what it had before its first call: no other call


@dataclass(frozen=True)
class _State:
    """What a call must leave as it found it for the process to serve another: its pipes
    (a tool that closed or replaced them), its open descriptors (one that leaked files),
    and, as a bound, its peak memory."""

    pipes: tuple[tuple[int, int], ...]
    fds: frozenset[str]
    rss_kb: int

    @staticmethod
    def now() -> _State:
        try:
            pipes = tuple((st.st_dev, st.st_ino) for st in (os.fstat(RESULT_FD), os.fstat(REQUEST_FD)))
            fds = frozenset(os.listdir("/proc/self/fd"))
        except OSError:  # no descriptor left to look with: as good as changed
            pipes, fds = (), frozenset()
        return _State(pipes, fds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _serve_and_stay(plan: Any, fn: Any, kwargs: dict[str, Any], may_stay: bool, start: _State) -> bool:
    """The call, then whether this process may serve another call of the run: said in the
    report, so that the worker keeps it, or not."""
    payload = _run_tool(fn, kwargs)
    _kill_own_uid()  # first: when the worker reads the result, nothing else runs
    stay = may_stay and not _children() and _fit(start)
    _report({**payload, "stay": stay})
    return stay


def _children() -> bool:
    """Did the call leave a process, running or ended? The process is its calls' subreaper:
    whatever they started and left, daemonized or not, is its child until reaped."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def _fit(start: _State) -> bool:
    """No thread of the tool's runs on, descriptors and pipes are as they were, its peak
    memory grew little, and its CPU is still far under its limit."""
    if threading.active_count() != 1:
        return False
    now = _State.now()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    unchanged = now.pipes == start.pipes and bool(now.pipes) and now.fds == start.fds
    cpu = usage.ru_utime + usage.ru_stime
    return unchanged and now.rss_kb - start.rss_kb < REUSE_GROWTH_KB and cpu < REUSE_CPU_S


def _again(plan: Any, folder: int) -> None:
    """Before the run's next call: its folder, umask and environment again (the last call
    may have changed them), and its file-size limit: what the run's folder may still
    take now, never above the limit the process already has. The folder by the descriptor
    opened before the first call (the same folder: reuse.py's key), not by its path."""
    os.fchdir(folder)
    os.umask(0o007)
    scrub(plan.env)
    wanted = plan.policy.max_file_mb << 20
    if plan.room is not None:
        wanted = min(wanted, plan.room)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (min(wanted, hard), hard))
