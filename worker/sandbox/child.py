"""The call's own process: what it must know, found before the fork (``_Facts``); then,
in the child, a session, folder and environment of its own, limits, the call's uid,
and the tool's result reported on RESULT_FD; or, for the exec layers, the runner."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import resource
import signal
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NoReturn

from worker.sandbox.constants import FAILED_START, MAX_RESULT_BYTES, RESULT_FD
from worker.sandbox.context import SandboxError, jsonable
from worker.sandbox.env import scrub
from worker.sandbox.forget import forget_worker_state
from worker.sandbox.kernel import apply as apply_kernel_layers
from worker.sandbox.libc import _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS, _PR_SET_PDEATHSIG, _libc
from worker.sandbox.paths import _inside, _module_path
from worker.sandbox.plan import _Plan

if TYPE_CHECKING:
    from orchestrator.models import SandboxPolicy

# Python ignores SIGPIPE and SIGXFSZ so that writes fail with an error: kept that way.
_KEEP = {signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE, signal.SIGXFSZ}
_RESET_SIGNALS = [s for s in signal.Signals if s not in _KEEP]


@dataclass
class _Facts:
    """What the call's process needs to know about itself, found before the fork: in
    the child every page Python touches is a copy-on-write fault (the hot path)."""

    # The worker's open descriptors, pointed at /dev/null in the child (objects of its
    # copied heap hold their numbers); None: a fork server's, closed (its objects never close them).
    fds: list[int] | None
    handlers: list[signal.Signals]  # signals with a handler of the worker's
    limits: list[tuple[int, tuple[int, int]]]


def _facts(plan: _Plan) -> _Facts:
    fork = plan.layer == "fork"
    return _Facts(
        fds=[int(n) for n in os.listdir("/proc/self/fd")] if fork else [],
        handlers=_handlers(os.getpid()),
        limits=_limits(plan.policy, nproc=os.geteuid() == 0, fork=fork, room=plan.room),
    )


@lru_cache(maxsize=4)
def _handlers(pid: int) -> list[signal.Signals]:
    """Signals this process handles (Celery's, set at start): looked up once per process."""
    return [s for s in _RESET_SIGNALS if signal.getsignal(s) not in (signal.SIG_DFL, None)]


def _child(plan: _Plan, facts: _Facts, fn: Callable[..., Any], kwargs: dict[str, Any],
           write_fd: int, parent: int, stderr_fd: int | None = None) -> NoReturn:  # fmt: skip
    code = 1
    try:
        stderr = fcntl.fcntl(stderr_fd, fcntl.F_DUPFD, 10) if stderr_fd is not None else None  # (not 0-3)
        os.dup2(write_fd, RESULT_FD)  # first: errors below are reported through it
        _isolate(plan, facts, () if stderr is None else (stderr,))
        if plan.layer == "fork":
            _confine(plan, facts, parent, drop=plan.gid is not None)
            code = _serve(plan, fn, kwargs)
        else:
            _exec_runner(plan, facts, parent, stderr)
    except BaseException as exc:
        _report_failed_start(exc)
    finally:
        os._exit(code)


def _report_failed_start(exc: BaseException) -> None:
    """The sandbox, not the tool, failed (the tool's own errors are ``_serve``'s): marked so
    that the worker's log says it once (worker/sandbox/call.py ``_decode``)."""
    with contextlib.suppress(BaseException):
        _report({"error": f"SandboxError: {type(exc).__name__}: {exc}", FAILED_START: True})


def _isolate(plan: _Plan, facts: _Facts, keep: tuple[int, ...] = ()) -> None:
    """Session, signals, descriptors, folder, environment: nothing of the worker's."""
    net_fd = plan.confine.net_fd if plan.confine is not None else None
    _detach(facts, forked=plan.layer == "fork", keep=(*keep, net_fd) if net_fd is not None else keep)
    _enter(plan)


def _detach(facts: _Facts, forked: bool, keep: tuple[int, ...] = ()) -> None:
    """Its own session, default signal handlers, none of the worker's descriptors."""
    os.setsid()
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in facts.handlers:  # none of the worker's handlers (Celery's SIGTERM...)
        signal.signal(sig, signal.SIG_DFL)
    _stdio_to_devnull(facts.fds if forked else None, keep)


def _enter(plan: _Plan) -> None:
    """The run's folder and the allowlisted environment (the exec layers get it at exec)."""
    os.chdir(plan.workdir)  # (as root: a folder the worker was given may be another user's)
    os.umask(0o007)  # files stay the run's group's
    if plan.layer == "fork":
        scrub(plan.env)


def _confine(plan: _Plan, facts: _Facts, parent: int, drop: bool) -> None:
    """Limits, no_new_privs, the call's uid, death with the worker."""
    for which, limit in facts.limits:
        if which == resource.RLIMIT_NOFILE and facts.fds:
            limit = _past_held(limit, len(facts.fds))
        resource.setrlimit(which, limit)
    prctl = _libc().prctl
    prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # setuid binaries gain nothing
    # Its /proc/self/environ still shows the worker's environment block (a forked copy):
    # not dumpable, /proc/self/* belongs to root. (Setting a new uid does this too.)
    prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    if plan.confine is not None and plan.layer != "bwrap":  # (bwrap: the runner, inside it)
        apply_kernel_layers(plan.confine)  # before the drop: root opens the paths of its rules
    if drop:
        assert plan.gid is not None and plan.uid is not None
        _drop(plan.uid, plan.gid)
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after the drop, which clears it
    if os.getppid() != parent:
        raise SandboxError("the worker died")


def _stdio_to_devnull(inherited: list[int] | None, keep: tuple[int, ...] = ()) -> None:
    """0-2 -> /dev/null; every other inherited descriptor (Redis sockets, the broker
    connection, log files) is closed (``inherited`` None: an exec follows), or, in the
    forked interpreter whose objects still hold those numbers, pointed at /dev/null so
    that no number is reused under them."""
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        if fd != null:
            os.dup2(null, fd)
    if inherited is None:
        last = RESULT_FD
        for fd in sorted(keep):
            os.closerange(last + 1, fd)
            last = fd
        os.closerange(last + 1, 1 << 20)
        return
    for fd in inherited:
        if fd > RESULT_FD and fd != null and fd not in keep:
            with contextlib.suppress(OSError):
                os.dup2(null, fd)
    if null > RESULT_FD:
        os.close(null)


def _limits(policy: SandboxPolicy, nproc: bool, fork: bool,
            room: int | None = None) -> list[tuple[int, tuple[int, int]]]:  # fmt: skip
    """The call's rlimits; ``room``: what the run's folder may still take (worker/sandbox/quota.py)."""
    mb = 1024 * 1024
    memory = policy.memory_mb * mb
    if fork:  # the forked worker's own mappings are not the call's to spend
        memory += _address_space()
    fsize = policy.max_file_mb * mb if room is None else min(policy.max_file_mb * mb, room)
    wanted = {
        resource.RLIMIT_CPU: (policy.cpu_s, policy.cpu_s + 1),  # SIGXCPU, then SIGKILL
        resource.RLIMIT_AS: (memory, memory),
        resource.RLIMIT_FSIZE: (fsize, fsize),  # one file; the folder: worker/sandbox/quota.py
        resource.RLIMIT_NOFILE: (policy.max_open_files, policy.max_open_files),
        resource.RLIMIT_CORE: (0, 0),  # a core file would hold the worker's memory
    }
    if nproc:  # counted per real uid: meaningful only with a uid of the call's own
        wanted[resource.RLIMIT_NPROC] = (policy.max_processes, policy.max_processes)
    limits = []
    for which, (soft, hard) in wanted.items():
        current_hard = _hard_limit(which)
        if current_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        limits.append((which, (soft, hard)))
    return limits


def _past_held(limit: tuple[int, int], held: int) -> tuple[int, int]:
    """A forked call keeps the worker's descriptor numbers (pointed at /dev/null, see
    ``_stdio_to_devnull``): a limit counted from zero would leave it none to open when the
    worker holds many. It may open ``max_open_files`` more than it inherited."""
    cap = _hard_limit(resource.RLIMIT_NOFILE)
    soft, hard = (n + held for n in limit)
    if cap != resource.RLIM_INFINITY:
        soft, hard = min(soft, cap), min(hard, cap)
    return soft, hard


@lru_cache(maxsize=16)
def _hard_limit(which: int) -> int:
    return resource.getrlimit(which)[1]


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def _drop(uid: int, gid: int) -> None:
    os.setgroups([gid])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise SandboxError("could not drop to the call's uid")


def _serve(plan: _Plan, fn: Callable[..., Any], kwargs: dict[str, Any]) -> int:
    payload = _run_tool(fn, kwargs)
    if plan.gid is not None:
        _kill_own_uid()  # first: when the worker reads the result, nothing else runs
    _report(payload)
    return 0


def _run_tool(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    forget_worker_state()  # a copy of the worker's heap: its settings, clients and keys dropped
    try:
        return {"ok": jsonable(fn(**kwargs))}
    except BaseException as exc:  # the model sees every failure, whatever its type
        return {"error": f"{type(exc).__name__}: {exc}"}


def _kill_own_uid() -> None:
    """End whatever the call started (setsid'd or not) before reporting the end."""
    uid = os.getuid()
    if uid != 0 and os.geteuid() != 0:
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)  # all processes of this uid but this one


def _report(payload: dict[str, Any]) -> None:
    data = json.dumps(payload).encode()
    if len(data) > MAX_RESULT_BYTES:
        data = json.dumps({"error": f"OutputTooLarge: {len(data)} bytes of output"}).encode()
    view = memoryview(len(data).to_bytes(8, "big") + data)
    while view:
        view = view[os.write(RESULT_FD, view) :]


def _runner_confinement(plan: _Plan) -> dict | None:
    """Under bwrap, the runner applies Landlock and seccomp itself (bwrap's own mounts come
    first); its network ruleset crosses bwrap as an inherited descriptor."""
    conf = plan.confine
    if plan.layer != "bwrap" or conf is None:
        return None
    if conf.net_fd is not None:
        os.set_inheritable(conf.net_fd, True)
    return {"landlock": conf.landlock, "bpf": conf.bpf, "net_fd": conf.net_fd}


def _exec_runner(plan: _Plan, facts: _Facts, parent: int, stderr: int | None = None) -> NoReturn:
    """Replace this process with the runner; its request arrives on stdin (a memfd).
    The request is written before the limits: this process is still the worker's size.
    ``stderr``: a pipe the worker reads if the tool never reports (bwrap's or the
    interpreter's message: the runner points its stderr at /dev/null once it runs)."""
    request = {
        "path": [p for p in _module_path() if not _inside(p, plan.workdir)],
        "module": plan.target[0],
        "qualname": plan.target[1],
        "kwargs": plan.kwargs_blob,
        "drop": (plan.uid, plan.gid) if plan.gid is not None else None,
        "parent": parent if plan.layer == "exec" else None,  # outside bwrap: re-arm pdeathsig
        "confine": _runner_confinement(plan),
        "chdir": plan.workdir if plan.layer == "bwrap" else None,  # (exec: entered as root, below)
    }
    fd = os.memfd_create("tooloop-call", 0)
    os.write(fd, pickle.dumps(request))
    os.lseek(fd, 0, os.SEEK_SET)
    os.dup2(fd, 0)
    os.close(fd)
    _confine(plan, facts, parent, drop=False)  # the runner drops, after importing the tool
    if stderr is not None:
        os.set_blocking(stderr, False)  # a flood of messages is cut, never waited on
        os.dup2(stderr, 2)
        os.close(stderr)
    os.execve(plan.argv[0], plan.argv, plan.env)
