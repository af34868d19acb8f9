"""Run one tool call in a child process with limits and a hard deadline.

The always-on layer: a forked child per call, in its own session, working in
the run's folder, with rlimits; the whole process group is killed at the
deadline or when ``on_tick`` says stop (abort). The tool task never waits on a
call that will not report.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orchestrator.models import SandboxPolicy

TICK_S = 0.25


@dataclass
class CallOutcome:
    ok: bool
    output: Any = None
    error: str | None = None  # "<type>: <message>", fed back to the model
    duration_ms: float = 0.0


@dataclass
class SandboxContext:
    workdir: str
    timeout_s: float
    policy: SandboxPolicy
    on_tick: Callable[[], bool] = lambda: True  # False: stop the call now (abort)


def prepare_workdir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


def jsonable(value: Any) -> Any:
    """Outputs are JSON values; anything else becomes its ``str``."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


def run_call(fn: Callable[..., Any], kwargs: dict[str, Any], ctx: SandboxContext) -> CallOutcome:
    started = time.perf_counter()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns
        os.close(read_fd)
        _child(fn, kwargs, ctx, write_fd)
    os.close(write_fd)
    try:
        outcome = _collect(pid, read_fd, ctx)
    finally:
        os.close(read_fd)
    outcome.duration_ms = round((time.perf_counter() - started) * 1000, 3)
    return outcome


def _child(fn: Callable[..., Any], kwargs: dict[str, Any], ctx: SandboxContext, fd: int) -> None:
    code = 0
    try:
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(ctx.workdir)
        _limit(ctx.policy)
        try:
            payload = {"ok": jsonable(fn(**kwargs))}
        except BaseException as exc:  # the model sees every failure, whatever its type
            payload = {"error": f"{type(exc).__name__}: {exc}"}
        data = json.dumps(payload).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _limit(policy: SandboxPolicy) -> None:
    mb = 1024 * 1024
    limits = {
        resource.RLIMIT_CPU: (policy.cpu_s, policy.cpu_s + 1),
        resource.RLIMIT_AS: (policy.memory_mb * mb, policy.memory_mb * mb),
        resource.RLIMIT_FSIZE: (policy.max_file_mb * mb, policy.max_file_mb * mb),
        resource.RLIMIT_NOFILE: (policy.max_open_files, policy.max_open_files),
    }
    for which, (soft, hard) in limits.items():
        _, current_hard = resource.getrlimit(which)
        if current_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        resource.setrlimit(which, (soft, hard))


def _collect(pid: int, fd: int, ctx: SandboxContext) -> CallOutcome:
    deadline = time.monotonic() + ctx.timeout_s
    chunks: list[bytes] = []
    next_tick = time.monotonic() + TICK_S
    while True:
        now = time.monotonic()
        if now >= deadline:
            _kill(pid)
            return CallOutcome(False, error=f"Timeout: tool call exceeded {ctx.timeout_s:g}s")
        if now >= next_tick:
            next_tick = now + TICK_S
            if not ctx.on_tick():
                _kill(pid)
                return CallOutcome(False, error="Aborted: the run ended while the tool ran")
        ready, _, _ = select.select([fd], [], [], max(0.0, min(deadline, next_tick) - now))
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if chunk:
            chunks.append(chunk)
            continue
        break  # EOF: the child wrote its result or died
    _, status = os.waitpid(pid, 0)
    _kill_group(pid)  # anything the call left behind in its group
    return _decode(b"".join(chunks), status)


def _decode(data: bytes, status: int) -> CallOutcome:
    if data:
        payload = json.loads(data)
        if "ok" in payload:
            return CallOutcome(True, output=payload["ok"])
        return CallOutcome(False, error=payload["error"])
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        return CallOutcome(False, error=f"Killed: tool process died on {name} (a limit?)")
    return CallOutcome(False, error=f"Crashed: tool process exited {os.WEXITSTATUS(status)}")


def _kill(pid: int) -> None:
    _kill_group(pid)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
