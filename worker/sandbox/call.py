"""The worker's side of one call: start it (a spare, or a fork), watch it until it
reports, exits, runs out of time or is aborted, kill and reap what is left, decode."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from worker.sandbox.child import _child, _facts
from worker.sandbox.constants import EXIT_GRACE_S, FAILED_START, MAX_RESULT_BYTES, STARTED_MARK, TICK_S
from worker.sandbox.context import CallOutcome, SandboxContext, SandboxError
from worker.sandbox.plan import _Plan, _plan
from worker.sandbox.polling import readable
from worker.sandbox.quota import QUOTA_TICK_S, over_message
from worker.sandbox.reaper import (
    _become_subreaper,
    _children,
    _is_sandbox_process,
    _kill_uid,
    _proc_identity,
    _reap_sandbox_zombies,
    _sweep,
)
from worker.sandbox.reuse import keep
from worker.sandbox.spare import _pending, _run_pending, _Spare, _take_spare

log = logging.getLogger(__name__)


def run_call(fn: Callable[..., Any], kwargs: dict[str, Any], ctx: SandboxContext) -> CallOutcome:
    _run_pending()
    started = time.perf_counter()
    try:
        plan = _plan(fn, kwargs, ctx)
    except (SandboxError, OSError) as exc:
        outcome = CallOutcome(False, error=f"SandboxError: {exc}")
    else:
        outcome = _Call(plan, ctx).run(fn, kwargs)
    outcome.duration_ms = round((time.perf_counter() - started) * 1000, 3)
    return outcome


class _Call:
    """The worker's side of one call: fork, watch, kill what is left, decode."""

    def __init__(self, plan: _Plan, ctx: SandboxContext) -> None:
        self.plan, self.ctx = plan, ctx
        self.root = os.geteuid() == 0
        self.pid = 0
        self.exited = False
        self.status: int | None = None  # set when reaped while watching (no pidfd)
        self.clean = False  # ended the usual way: only zombies may be left to reap
        self.spare: _Spare | None = None  # the spare process that ran the call
        self.stderr_fd: int | None = None  # exec layers: what bwrap or Python said before the tool ran

    def run(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> CallOutcome:
        _become_subreaper()
        spare = _take_spare(fn, kwargs, self.plan, self.ctx.run_id, self.ctx.defer_cleanup)
        before = set() if self.root else set(_children()) - {spare.pid if spare else 0}
        if spare is not None:
            self.pid, read_fd, self.spare = spare.pid, spare.result_fd, spare
        else:
            started = self._fork(fn, kwargs)
            if isinstance(started, CallOutcome):
                return started
            read_fd = started
        reader, stopped, pidfd, status, stderr = _Reader(), "interrupted", None, 0, ""
        try:
            pidfd = _pidfd(self.pid)
            stopped = self._watch(read_fd, pidfd, reader)
        finally:
            if stopped is None and not self.exited and self._stays(reader):
                # It served the call cleanly and may serve the run's next one (reuse.py).
                if pidfd is not None:
                    os.close(pidfd)
                assert self.spare is not None and self.ctx.run_id is not None
                keep(self.ctx.run_id, self.plan, self.spare)
            elif self.ctx.defer_cleanup and stopped is None and reader.complete and not self.exited:
                # The hot path: the result is in; its process ends off the critical path.
                _pending.append(lambda: self._cleanup(read_fd, pidfd, reader, before, None))
            else:
                status = self._cleanup(read_fd, pidfd, reader, before, stopped)
            if self.stderr_fd is not None:
                stderr = _said(self.stderr_fd) if not reader.complete else ""
                os.close(self.stderr_fd)
        if stopped:
            return CallOutcome(False, error=stopped)
        return _decode(reader, status, self.plan.layer, stderr)

    def _stays(self, reader: _Reader) -> bool:
        """Its process reported and said it may serve another call of the run (reuse.py)."""
        if self.spare is None or not self.spare.reusable or not reader.complete:
            return False
        try:
            payload = reader.payload()
        except ValueError:
            return False
        return isinstance(payload, dict) and payload.get("stay") is True

    def _fork(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> int | CallOutcome:
        """Fork the call's process now (no spare): its result pipe, or why it failed."""
        read_fd, write_fd = os.pipe()
        err_r, err_w = os.pipe() if self.plan.layer != "fork" else (None, None)
        parent = os.getpid()
        facts = _facts(self.plan)
        try:
            self.pid = os.fork()
        except OSError as exc:
            for fd in (read_fd, write_fd, err_r, err_w):
                if fd is not None:
                    os.close(fd)
            return CallOutcome(False, error=f"SandboxError: cannot start the call's process: {exc}")
        if self.pid == 0:  # child: never returns
            _child(self.plan, facts, fn, kwargs, write_fd, parent, err_w)
        os.close(write_fd)
        if err_w is not None:
            os.close(err_w)
            self.stderr_fd = err_r
            os.set_blocking(err_r, False)
        return read_fd

    def _cleanup(self, read_fd: int, pidfd: int | None, reader: _Reader, before: set[int],
                 stopped: str | None) -> int:  # fmt: skip
        """Kill and reap the call's processes; whatever happened, nothing of it survives."""
        try:
            if stopped is None and not self.exited:
                self._await_exit(pidfd)
            status = self._finish(reader, clean_stop=stopped is None)
        finally:
            if pidfd is not None:
                os.close(pidfd)
            os.close(read_fd)
            if not (self.clean and _reap_sandbox_zombies()):
                _sweep(self._ours(before))
        return status

    def _await_exit(self, pidfd: int | None) -> None:
        """A call that reported kills its own uid and exits: give it EXIT_GRACE_S."""
        if pidfd is not None:
            self.exited = bool(readable([pidfd], EXIT_GRACE_S))
            return
        deadline = time.monotonic() + EXIT_GRACE_S
        while not self._reaped() and time.monotonic() < deadline:
            time.sleep(0.001)
        self.exited = self.status is not None

    def _watch(self, read_fd: int, pidfd: int | None, reader: _Reader) -> str | None:
        """Until the process exits (or reported and lingers): None, else why it is stopped."""
        os.set_blocking(read_fd, False)
        deadline = time.monotonic() + self.ctx.timeout_s
        next_tick = time.monotonic() + TICK_S
        next_count = time.monotonic() + QUOTA_TICK_S  # the run folder's quota (short calls: never)
        watched = [read_fd] if pidfd is None else [read_fd, pidfd]
        while not self.exited:
            now = time.monotonic()
            if reader.complete:
                if self.plan.layer == "fork":
                    return None  # the result is in: its exit is awaited off the hot path
                deadline = min(deadline, reader.complete_at + EXIT_GRACE_S)  # let it exit
                if now >= deadline:
                    return None
            elif now >= deadline:
                return f"Timeout: tool call exceeded {self.ctx.timeout_s:g}s"
            if now >= next_tick:
                next_tick = now + TICK_S
                if not self._still_wanted():
                    return "Aborted: the run ended while the tool ran"
                if now >= next_count:
                    next_count = now + QUOTA_TICK_S
                    over = over_message(self.plan.workdir, self.plan.quota)
                    if over:
                        return over
            wait = max(0.0, min(deadline, next_tick) - now)
            ready = readable(watched, wait if pidfd is not None else min(wait, 0.01))
            if read_fd in ready and not reader.pull(read_fd):
                watched.remove(read_fd)  # EOF; the process may still run
            if pidfd in ready or (pidfd is None and self._reaped()):
                self.exited = True
                reader.drain(read_fd)
            if reader.overflow:
                return f"OutputTooLarge: the tool's output exceeds {MAX_RESULT_BYTES >> 20} MiB"
        return None

    def _reaped(self) -> bool:
        """Without a pidfd: has the call's process exited? (reaps it)"""
        if self.spare is not None and self.spare.server is not None:  # not our child: its server's
            if not self.spare.ended():
                return False
            self.status = self.spare.wait()
            return True
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid:
            self.status = status
        return bool(pid)

    def _still_wanted(self) -> bool:
        """``on_tick`` (the lease heartbeat); a failing one (Redis away) does not stop the call."""
        try:
            return self.ctx.on_tick()
        except Exception:
            log.warning("sandbox: on_tick failed; the call goes on", exc_info=True)
            return True

    def _finish(self, reader: _Reader, clean_stop: bool) -> int:
        """Kill the call's processes (all of them) and reap the call's own process."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # its session, whatever its uid
        if not self.exited:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        status = self.status
        if status is None:
            try:
                status = self.spare.wait() if self.spare is not None else os.waitpid(self.pid, 0)[1]
            except ChildProcessError:
                status = 0
            except OSError:  # the fork server died, and its calls with it
                status = signal.SIGKILL
        reported = clean_stop and reader.complete and os.WIFEXITED(status) and status == 0
        if self.plan.uid is not None and not reported:  # it did not get to kill(-1) its own uid: we do
            _kill_uid(self.plan.uid)
        # The hot path: a forked call that reported, then killed all of its uid itself.
        self.clean = reported and self.root and self.plan.layer == "fork"
        return status

    def _ours(self, before: set[int]) -> Callable[[int], bool]:
        """Which children of this process (as subreaper) belong to sandboxed calls: a
        sandbox uid's, or bwrap's own (its namespace init, root, is orphaned when bwrap
        exits: left alone it stays a zombie of this process)."""
        if self.root:
            return lambda pid: _is_sandbox_process(*_proc_identity(pid))
        return lambda pid: pid not in before


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits; None where seccomp refuses
    pidfd_open (older Docker profiles): the watch then polls waitpid every 10 ms."""
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


class _Reader:
    """The framed result: 8-byte big-endian length, then that much JSON."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.complete_at = 0.0

    @property
    def size(self) -> int | None:
        return int.from_bytes(self.buf[:8], "big") if len(self.buf) >= 8 else None

    @property
    def complete(self) -> bool:
        size = self.size
        return size is not None and len(self.buf) >= 8 + size

    @property
    def overflow(self) -> bool:
        return (self.size or 0) > MAX_RESULT_BYTES or len(self.buf) > MAX_RESULT_BYTES + 8

    def pull(self, fd: int) -> bool:
        """One read; False on EOF."""
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return True
        self.buf += chunk
        if self.complete and not self.complete_at:
            self.complete_at = time.monotonic()
        return bool(chunk)

    def drain(self, fd: int) -> None:
        while not self.overflow and self.pull(fd):
            if not readable([fd], 0):
                return

    def payload(self) -> dict[str, Any] | None:
        if not self.complete:
            return None
        return json.loads(bytes(self.buf[8 : 8 + (self.size or 0)]))


def _decode(reader: _Reader, status: int, layer: str, stderr: str = "") -> CallOutcome:
    """The call's outcome. ``stderr`` (exec layers): what its process wrote before the
    runner took over (bubblewrap's or the interpreter's own message: the tool never ran),
    then, once the runner marked that the tool started, the interpreter's report of a fatal
    signal (faulthandler: the error and the tool's stack)."""
    stderr, started, crash = stderr.partition(STARTED_MARK)
    # a failed start's cause is at its end; a crash report's first lines name it and the tool's frame
    stderr, crash = stderr.strip()[-MAX_SAID:], crash.strip()[:MAX_SAID]
    try:
        payload = reader.payload()
    except ValueError:  # a tool that wrote on the result pipe itself
        return CallOutcome(False, error="Crashed: the tool process sent an unreadable result")
    if payload is not None:
        if "ok" in payload:
            return CallOutcome(True, output=payload["ok"])
        if payload.get(FAILED_START):  # the sandbox failed before the tool ran: say so once
            _log_once(payload["error"])
        return CallOutcome(False, error=payload["error"])
    signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 0
    if layer == "bwrap" and code > 128:  # bwrap exits 128 + the signal that killed the tool
        signum, code = code - 128, 0
    name = signal.Signals(signum).name if signum in set(signal.Signals) else str(signum)
    how = f"died on {name}" if signum else f"exited {code}"
    if stderr and not started:
        error = f"SandboxError: the tool could not start in the {layer} sandbox ({how}): {stderr}"
        _log_once(error)
        return CallOutcome(False, error=error)
    if crash:  # the tool started, then its process died: what the interpreter said of it
        return CallOutcome(False, error=f"Crashed: tool process {how}: {crash}")
    if signum:
        return CallOutcome(False, error=f"Killed: tool process died on {name} (a limit?)")
    return CallOutcome(False, error=f"Crashed: tool process exited {code}")


MAX_SAID = 2000  # characters kept of a failed start's message (its end) or of a crash report (its start)


def _said(fd: int) -> str:
    """What the call's process wrote on its stderr pipe: before the runner closed it, and
    the runner's crash report (the pipe holds 64 KiB; the writer never blocks: its end is
    non-blocking). ``_decode`` keeps the end of each part."""
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 1 << 16):
            data += chunk
    return data.decode(errors="replace")


_logged: set[str] = set()


def _log_once(error: str) -> None:
    """The worker's log says why calls cannot start once per cause, not once per call."""
    if error not in _logged and len(_logged) < 256:
        _logged.add(error)
        log.warning("sandbox: %s", error)
