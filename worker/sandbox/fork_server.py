"""The fork server's own side: one small process per tools pool forks every call's process.

Started by ``zygote.py`` (the pool's side): a fresh interpreter that imports the worker's
tool modules and the sandbox, and nothing of Celery, Redis or the settings, with the
environment allowlist alone; nothing of the worker's is in its memory, so nothing of it
is in a call's. It dies with the process that started it (``PR_SET_PDEATHSIG``), and the
processes it forked die with it.

Every process of the pool talks to it over a connection of its own (a socket pair whose
end it sends over the shared control socket, ``SOCK_SEQPACKET``: one message each, never
interleaved). On a connection, one request at a time, each answered in turn:

  ``S``  a spare: from the stock, or forked now (pid, its two pipe ends)
  ``R``  the run's kept process, if one fits the call's key (pid, uid, its two pipe ends)
  ``K``  keep this process for the run's next call (its two pipe ends come with it)
  ``W``  the exit status of a process it forked (answered once it has exited: a wait
         never holds the other connections)
  ``F``  end the run's kept process; ``Q`` its pid; ``H`` the tools it imported

Because the kept processes live here, a run's next call finds its process whichever pool
process takes the call (before, each pool process kept its own: at 500 runs over 4 pool
processes a run's call found its process about one time in thirty). A process handed to a
connection and not given back (kept) or waited for is killed when that connection closes
(its pool process died, and the call with it). The server is its calls' subreaper: what
a call left behind, orphaned, is found among its children and killed.

With a stock (``TOOLOOP_SANDBOX_STOCK=N``), while no request comes it forks as many spares
as it was asked for within ``WINDOW_S`` (the peak of the last ``PEAK_S``), at most N; see
``zygote.py``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import os
import pickle
import resource
import signal
import socket
import struct
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from orchestrator.local import exited
from worker.sandbox.polling import readable

log = logging.getLogger(__name__)

FRAME = struct.Struct("!cq")  # op, argument (a pid, or the length of a pickled payload)
ANSWER = struct.Struct("!q")
TAKEN = struct.Struct("!qq")  # pid (0: none), uid (-1: a fresh spare, no uid yet)
KEPT_STATUSES = 4096  # exit statuses of processes nobody asked about yet, at most
SWEEP_S = 1.0  # how often orphans of calls are looked for, and idle kept processes ended
IDLE_S = 0.05  # no request for this long: the server forks a spare for its stock
WINDOW_S = 10.0  # the stock aims at the spares asked for within this long...
PEAK_S = 120.0  # ...at the most, over this long
STOCK_TTL_S = 60.0  # a stocked spare not asked for within this long ends
FD_RESERVE = 256  # descriptors kept free of kept processes' pipes (connections, waits, stock, a fork)
CONN_TIMEOUT_S = 10.0  # a request's remaining bytes: a connection that stalls mid-request is dropped


def tool_names(registry: dict[str, Any]) -> dict[str, str]:
    """name -> module:qualname, for the tools a fork server can run (plain functions)."""
    out = {}
    for name, entry in registry.items():
        fn = getattr(entry, "fn", None)
        module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if module and module != "__main__" and "<" not in qualname:
            out[name] = f"{module}:{qualname}"
    return out


def main() -> None:
    from worker.sandbox.libc import _PR_SET_CHILD_SUBREAPER, _PR_SET_PDEATHSIG, _libc

    stock, most, owner = int(sys.argv[-4]), int(sys.argv[-3]), int(sys.argv[-1])
    most = kept_within_fd_limit(most)
    keep_idle = float(sys.argv[-2])
    _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != owner:
        return
    _libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of calls come to us, to be killed
    control = socket.socket(fileno=int(os.environ.pop("TOOLOOP_ZYGOTE_FD")))
    _import(json.loads(os.environ.pop("TOOLOOP_ZYGOTE_MODULES", "[]")))
    from worker.registry import REGISTRY

    have = pickle.dumps(tool_names(REGISTRY))
    gc.collect()
    gc.freeze()  # the spares' collections never walk (and copy) the server's own objects
    _Server(control, have, stock, most, keep_idle).serve()


def kept_within_fd_limit(most: int) -> int:
    """As many kept processes as this process's descriptors allow (two pipe ends each, and
    FD_RESERVE for its connections, waits and stock), its soft limit raised to its hard
    one first: at the common soft limit of 1,024, 512 kept processes left no descriptor
    for the next spare's pipes."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    fits = max(0, (soft - FD_RESERVE) // 2) if soft != resource.RLIM_INFINITY else most
    if fits < most:
        log.warning("sandbox fork server: %d kept processes at most (TOOLOOP_SANDBOX_REUSE=%d): "
                    "%d descriptors allowed (ulimit -n)", fits, most, soft)  # fmt: skip
    return min(most, fits)


def _import(modules: list[str]) -> None:
    # What every spare runs, and what unpickling its call needs: imported once, here.
    import orchestrator.models  # noqa: F401
    import worker.sandbox.spare_child  # noqa: F401

    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # that module's tools fork from the worker
            log.warning("sandbox fork server: cannot import %s", module, exc_info=True)


@dataclass
class _Process:
    """A process this server forked, with the two pipe ends it is reached by."""

    pid: int
    request_w: int
    result_r: int
    made_at: float = field(default_factory=time.monotonic)

    def end(self) -> None:
        """Close its pipes: waiting for a request, it reads the end and exits (reaped here)."""
        for fd in (self.request_w, self.result_r):
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class _Kept:
    process: _Process
    key: str
    uid: int
    used_at: float


@dataclass
class _Conn:
    sock: socket.socket
    handed: set[int] = field(default_factory=set)  # pids given to it, not yet kept or waited for


class _Server:
    def __init__(self, control: socket.socket, have: bytes, stock: int, most: int, keep_idle: float) -> None:
        self.control, self.have, self.most, self.keep_idle = control, have, most, keep_idle
        self.conns: dict[int, _Conn] = {}
        self.done: dict[int, int] = {}  # pid -> exit status, until asked (bounded)
        self.ours: set[int] = set()  # spares forked here and not reaped: every other child is an orphan
        self.waits: dict[int, tuple[_Conn, int]] = {}  # pidfd -> (who waits, for which pid)
        self.kept: OrderedDict[str, _Kept] = OrderedDict()  # run id -> its process
        self.stock = _Stock(stock)
        self.last = time.monotonic()  # the last request
        self.swept = 0.0

    # -- the loop ------------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            wait = self.stock.idle(self, self.last) if self.stock.most else None
            wait = SWEEP_S if wait is None else min(wait, SWEEP_S)
            watched = [self.control, *(c.sock for c in self.conns.values()), *self.waits]
            ready = readable(watched, wait)
            self._reap()
            for item in ready:
                if item is self.control:
                    if not self._accept():
                        return  # every holder of the control socket is gone
                elif isinstance(item, socket.socket):
                    self._request(self.conns[item.fileno()])
            self._answer_waits()
            if time.monotonic() - self.swept >= min(SWEEP_S, self.keep_idle):
                self._expire()
                self._kill_orphans()
                self.swept = time.monotonic()

    def _accept(self) -> bool:
        try:
            data, fds, _, _ = socket.recv_fds(self.control, 1, 1)
        except OSError:
            return False
        if not data:
            return False
        for fd in fds:
            conn = _Conn(socket.socket(fileno=fd))
            conn.sock.settimeout(CONN_TIMEOUT_S)
            self.conns[fd] = conn
        return True

    def _drop(self, conn: _Conn) -> None:
        """Its pool process is gone: what it was handed and did not give back dies too."""
        self.conns.pop(conn.sock.fileno(), None)
        for pid in conn.handed & self.ours:  # not reaped yet: the pid is still that process's
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pidfd in [fd for fd, (who, _) in self.waits.items() if who is conn]:
            del self.waits[pidfd]
            os.close(pidfd)
        conn.sock.close()

    # -- requests ------------------------------------------------------------------------
    def _request(self, conn: _Conn) -> None:
        try:
            frame, fds, _, _ = socket.recv_fds(conn.sock, FRAME.size, 2)
            if len(frame) < FRAME.size:
                frame += exactly(conn.sock, FRAME.size - len(frame)) if frame else b""
        except OSError:
            frame, fds = b"", []
        if len(frame) < FRAME.size:
            for fd in fds:
                os.close(fd)
            self._drop(conn)
            return
        self.last = time.monotonic()
        op, arg = FRAME.unpack(frame)
        try:
            self._handle(conn, op, arg, fds)
        except OSError:
            self._drop(conn)

    def _handle(self, conn: _Conn, op: bytes, arg: int, fds: list[int]) -> None:
        if op == b"W":
            self._wait(conn, arg)
            return
        payload = pickle.loads(exactly(conn.sock, arg)) if op in b"RKFQ" and arg else None
        if op == b"S":
            self._hand(conn, self.stock.take(self), -1)
        elif op == b"R":
            run_id, key = payload
            kept = self._take_kept(run_id, key)
            if kept is None:
                conn.sock.sendall(TAKEN.pack(0, -1))
            else:
                self._hand(conn, kept.process, kept.uid)
        elif op == b"K":
            run_id, key, uid, pid = payload
            self._keep(conn, _Process(pid, *fds), run_id, key, uid)
            conn.sock.sendall(ANSWER.pack(0))
        elif op == b"F":  # the run's kept process (every one, without a run)
            for run_id in [payload] if payload else list(self.kept):
                kept = self.kept.pop(run_id, None)
                if kept is not None:
                    kept.process.end()
            conn.sock.sendall(ANSWER.pack(0))
        elif op == b"Q":
            kept = self.kept.get(payload)
            conn.sock.sendall(ANSWER.pack(kept.process.pid if kept else 0))
        elif op == b"H":
            conn.sock.sendall(len(self.have).to_bytes(8, "big") + self.have)

    def _hand(self, conn: _Conn, process: _Process, uid: int) -> None:
        """Give the process's pipe ends to the connection (this server closes its own)."""
        conn.handed.add(process.pid)
        try:
            socket.send_fds(conn.sock, [TAKEN.pack(process.pid, uid)], [process.request_w, process.result_r])
        finally:
            process.end()

    def _take_kept(self, run_id: str, key: str) -> _Kept | None:
        kept = self.kept.pop(run_id, None)
        if kept is None:
            return None
        fits = kept.key == key and time.monotonic() - kept.used_at < self.keep_idle
        if fits and kept.process.pid not in self.done and not _doomed(kept.process.pid):
            return kept
        kept.process.end()
        return None

    def _keep(self, conn: _Conn, process: _Process, run_id: str, key: str, uid: int) -> None:
        conn.handed.discard(process.pid)
        old = self.kept.pop(run_id, None)
        if old is not None and old.process.pid != process.pid:
            old.process.end()
        self.kept[run_id] = _Kept(process, key, uid, time.monotonic())
        while len(self.kept) > self.most:
            self.kept.popitem(last=False)[1].process.end()

    def _wait(self, conn: _Conn, pid: int) -> None:
        conn.handed.discard(pid)
        if pid in self.done:
            conn.sock.sendall(ANSWER.pack(self.done.pop(pid)))
            return
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:  # gone and reaped by someone else, or no such process
            conn.sock.sendall(ANSWER.pack(-(exc.errno or 10)))
            return
        self.waits[pidfd] = (conn, pid)
        self._answer_waits()

    def _answer_waits(self) -> None:
        for pidfd, (conn, pid) in list(self.waits.items()):
            if pid not in self.done:
                if pid in self.ours:
                    continue
                status = -10  # not ours (ECHILD)
            else:
                status = self.done.pop(pid)
            del self.waits[pidfd]
            os.close(pidfd)
            try:
                conn.sock.sendall(ANSWER.pack(status))
            except OSError:
                self._drop(conn)

    # -- children ------------------------------------------------------------------------
    def fork(self, ahead: bool) -> _Process:
        """A spare holding its two pipe ends; ``ahead``: for the stock (niced, when root)."""
        process = self.stock.fork(ahead)
        self.ours.add(process.pid)
        return process

    def _reap(self) -> None:
        for pid, status in exited():
            if pid in self.ours:
                self.ours.discard(pid)
                self.done[pid] = status
            if len(self.done) > KEPT_STATUSES:
                self.done.pop(next(iter(self.done)))

    def _expire(self) -> None:
        now = time.monotonic()
        for run_id in [r for r, k in self.kept.items() if now - k.used_at >= self.keep_idle]:
            self.kept.pop(run_id).process.end()

    def _kill_orphans(self) -> None:
        """Children this server did not fork: what a call left when its process ended."""
        for pid in _children():
            if pid not in self.ours:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._reap()


def _children() -> list[int]:
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


class _Stock:
    """Spares forked ahead of their request (see ``zygote.py``)."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.spares: deque[_Process] = deque()
        self.asked: deque[float] = deque()  # when spares were asked for, within WINDOW_S
        self.peak, self.peak_at = 0, 0.0
        self.root = may_renice()  # a spare forked at nice 19 can take its priority back
        self.nice = os.getpriority(os.PRIO_PROCESS, 0)  # the server's own: a spare's once it has a call

    def wanted(self, now: float) -> int:
        while self.asked and now - self.asked[0] > WINDOW_S:
            self.asked.popleft()
        if len(self.asked) >= self.peak or now - self.peak_at > PEAK_S:
            self.peak, self.peak_at = len(self.asked), now
        return min(self.most, self.peak)

    def fork(self, ahead: bool) -> _Process:
        from worker.sandbox.spare_child import fork_spare

        request_r, request_w = os.pipe()
        result_r, result_w = os.pipe()
        niced = ahead and self.root
        try:
            if niced:
                os.setpriority(os.PRIO_PROCESS, 0, 19)
            pid = fork_spare(request_r, result_w, None, renice=self.nice if niced else None)
        except BaseException:
            os.close(request_w)
            os.close(result_r)
            raise
        finally:
            if niced:
                os.setpriority(os.PRIO_PROCESS, 0, self.nice)
            os.close(request_r)
            os.close(result_w)
        return _Process(pid, request_w, result_r)

    def take(self, server: _Server) -> _Process:
        self.asked.append(time.monotonic())
        while self.spares:
            spare = self.spares.popleft()
            if spare.pid not in server.done and not _doomed(spare.pid):  # (killed while it waited: the next)
                return spare
            spare.end()
        return server.fork(ahead=False)

    def idle(self, server: _Server, since: float) -> float | None:
        """While no request comes: fork one spare for the stock, or end a stale one. The
        time to wait for a request before the next step (None: until one comes)."""
        now = time.monotonic()
        for spare in [s for s in self.spares if s.pid in server.done or now - s.made_at > STOCK_TTL_S]:
            self.spares.remove(spare)
            spare.end()
        if len(self.spares) >= self.wanted(now):
            return STOCK_TTL_S if self.spares else (WINDOW_S if self.asked else None)
        if now - since < IDLE_S:
            return IDLE_S - (now - since)
        try:
            self.spares.append(server.fork(ahead=True))
        except OSError:
            log.warning("sandbox fork server: cannot fork a spare ahead", exc_info=True)
            return IDLE_S * 20
        return 0.0


def _doomed(pid: int) -> bool:
    """Exited, or killed and not yet gone (a SIGKILL pending: a spare at nice 19 on a busy box
    may take a while to die)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        pending = int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)
        return status["State"].split()[0] in ("Z", "X") or bool(pending >> (signal.SIGKILL - 1) & 1)
    except (OSError, KeyError, ValueError, IndexError):
        return True


def may_renice() -> bool:
    """Whether this process may lower a niceness (CAP_SYS_NICE: root, outside Docker's default
    capabilities): only then is the stock forked at nice 19."""
    try:
        with open("/proc/self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:"))
        return bool(int(caps.split()[1], 16) >> 23 & 1)
    except (OSError, StopIteration, ValueError, IndexError):
        return False


def exactly(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock`` (OSError if it closes first)."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise OSError("the connection closed mid-request")
        data += chunk
    return data


if __name__ == "__main__":
    main()
