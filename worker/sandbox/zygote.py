"""The fork server: forked calls start from a small process, not from the worker.

Forking the tool worker (a ~76 MB Celery pool process) for every call cost ~20 ms of
CPU per call here, most of it in the kernel: copying and tearing down its page tables,
and the copy-on-write faults of every page the worker then writes while the call's
process shares them (measured: tool pool CPU per tool-turn 27 ms with the fork, 6 ms
with the call run in-process; ``docs/benchmarks.md``). So each pool process starts one
fork server (``worker.sandbox.zygote.main``): a fresh interpreter that imports the
worker's tool modules and the sandbox, and nothing of Celery, Redis or the settings, with
the environment allowlist alone (``env.py``): nothing of the worker's is in its memory.
It forks the spare processes (``worker/sandbox/spare_child.py``) on request; the worker keeps
watching, killing and decoding each call as before, and asks the server for the exit
status of the processes it forked. Dies with its worker (``PR_SET_PDEATHSIG``), and the
calls' processes die with it.

A tool the server did not import the same way (defined in ``__main__``, registered
after the server started) is forked from the worker, as before.

With ``TOOLOOP_SANDBOX_STOCK=N`` the server keeps a stock of spares, forked while no
request comes (``IDLE_S``), as many as it was asked for within ``WINDOW_S`` at the most (the
peak of the last ``PEAK_S``), at most N. Calls arrive in bursts (every run's model answers
at about the same time): the fork and the spare's start (~1.8 ms of CPU of the ~4-5 ms a
call's process costs) are then paid between the bursts. A server that may take a priority
back (CAP_SYS_NICE) forks its stock at nice 19, and each spare takes the server's priority
back when it is handed its call, before it confines itself. Stocked spares not asked for
within ``STOCK_TTL_S`` end; each waits as a process of ~1.8 MB PSS. Off by default (0): in
``bench/concurrency.py`` (100 and 500 runs, load 10-17) no gain in efficiency could be told
from the load's noise, while the stock forked and not used (at the end of a burst) added
~1-1.5 ms of CPU per call (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

_FRAME = struct.Struct("!cq")  # op, argument: b"S" a spare (its two fds come back), b"W" wait for pid
_ANSWER = struct.Struct("!q")
_BOOT = (
    "import os, sys; sys.path[:] = os.environ.pop('TOOLOOP_ZYGOTE_PATH').split(os.pathsep); "
    "from worker.sandbox.zygote import main; main()  # tooloop sandbox fork server"
)
_KEPT_STATUSES = 4096  # exit statuses of processes nobody asked about yet, at most
START_TIMEOUT_S = 60.0  # for the server to import the tool modules (a hung import: no server)
DEFAULT_STOCK = 0  # spares forked ahead at most (TOOLOOP_SANDBOX_STOCK; off: see the notes)
IDLE_S = 0.05  # no request for this long: the server forks a spare for its stock
WINDOW_S = 10.0  # the stock aims at the spares asked for within this long...
PEAK_S = 120.0  # ...at the most, over this long
STOCK_TTL_S = 60.0  # a stocked spare not asked for within this long ends


def stock_size() -> int:
    """Spares a fork server forks ahead, at most (``TOOLOOP_SANDBOX_STOCK``; 0: none)."""
    try:
        return max(0, int(os.environ.get("TOOLOOP_SANDBOX_STOCK", DEFAULT_STOCK)))
    except ValueError:
        return DEFAULT_STOCK


def tool_names(registry: dict[str, Any]) -> dict[str, str]:
    """name -> module:qualname, for the tools a fork server can run (plain functions)."""
    out = {}
    for name, entry in registry.items():
        fn = getattr(entry, "fn", None)
        module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if module and module != "__main__" and "<" not in qualname:
            out[name] = f"{module}:{qualname}"
    return out


class Zygote:
    """The worker's handle on its fork server."""

    def __init__(self) -> None:
        from worker.registry import REGISTRY
        from worker.sandbox.env import base_environment

        os.close(os.pidfd_open(os.getpid()))  # the worker watches the server's calls by pidfd
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The allowlist alone (worker/sandbox/env.py): every forked call is a copy of the
        # server, so nothing of the worker's environment (keys, passwords, URLs) is in it.
        env = base_environment()
        env.update(TOOLOOP_ZYGOTE_FD=str(theirs.fileno()), TOOLOOP_ZYGOTE_PATH=os.pathsep.join(sys.path))
        command = [sys.executable, "-c", _BOOT, str(stock_size()), str(os.getpid())]
        self.proc = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()  # one request and its answer at a time
        self._wanted = tool_names(REGISTRY)
        self._tools: set[str] | None = None  # its answer: read when first asked (``tools``)
        try:  # it imports the tool modules, then says which tools it found the same way
            self.sock.settimeout(START_TIMEOUT_S)
            hello = pickle.dumps(sorted({where.split(":")[0] for where in self._wanted.values()}))
            self.sock.sendall(len(hello).to_bytes(8, "big") + hello)
        except BaseException:
            self.stop()
            raise

    @property
    def tools(self) -> set[str]:
        """The tools it runs: those it imported as this process did. Its answer is read when
        first asked, so that a server started early (``start_early``) imports meanwhile; a
        server that does not answer is stopped and runs none (its calls fork from the worker)."""
        with self.lock:
            if self._tools is None:
                try:
                    size = int.from_bytes(self._exactly(8), "big")
                    have: dict[str, str] = pickle.loads(self._exactly(size))
                    self.sock.settimeout(None)
                except (OSError, EOFError, pickle.UnpicklingError):
                    log.warning("sandbox: the fork server did not start; calls fork from the worker",
                                exc_info=True)  # fmt: skip
                    self.stop()
                    have = {}
                self._tools = {name for name, where in self._wanted.items() if have.get(name) == where}
            return self._tools

    def alive(self) -> bool:
        return self.proc.poll() is None

    def take(self) -> tuple[int, int, int]:
        """A spare process: from the server's stock, or forked now. (pid, the end of its
        request pipe, the end of its result pipe)."""
        with self.lock:
            self.sock.sendall(_FRAME.pack(b"S", 0))
            data, fds, _, _ = socket.recv_fds(self.sock, _ANSWER.size, 2)
            if not data:
                raise OSError("the sandbox's fork server is gone")
            data += self._exactly(_ANSWER.size - len(data)) if len(data) < _ANSWER.size else b""
            (value,) = _ANSWER.unpack(data)
            if value < 0 or len(fds) != 2:
                for fd in fds:
                    os.close(fd)
                raise OSError(-value if value < 0 else 5, os.strerror(-value if value < 0 else 5))
            return value, fds[0], fds[1]

    def wait(self, pid: int) -> int:
        """The exit status of a process this server forked (it must be ending: killed or done)."""
        with self.lock:
            self.sock.sendall(_FRAME.pack(b"W", pid))
            return self._answer()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()

    def _answer(self) -> int:
        (value,) = _ANSWER.unpack(self._exactly(_ANSWER.size))
        if value < 0:
            raise OSError(-value, os.strerror(-value))
        return value

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise OSError("the sandbox's fork server is gone")
            data += chunk
        return data


_zygotes: dict[int, Zygote | None] = {}  # pool process pid -> its fork server (None: unavailable)


def start_early() -> None:
    """Start this process's fork server now, without waiting for it: a tool pool process
    does as it starts (``worker/tool_task.py``), so the server imports the tool modules while
    the worker is still starting. Started on first use instead, a fresh worker's first calls
    each waited for one (16 fresh interpreters at once: 7-12 s on this 2-core box, 30-60 s
    loaded), and a run whose step was sent again to a new worker stood still that much longer
    (``bench/chaos.py``)."""
    if os.environ.get("TOOLOOP_SANDBOX_FORK_SERVER", "1") == "0" or os.getpid() in _zygotes:
        return
    try:
        _zygotes[os.getpid()] = Zygote()
    except OSError:
        log.warning("sandbox: no fork server; calls fork from the worker", exc_info=True)
        _zygotes[os.getpid()] = None


def for_this_process() -> Zygote | None:
    """This process's fork server, started on first use (and again if it died). Only from
    the main thread: the server dies with the thread that started it (PR_SET_PDEATHSIG)."""
    if threading.current_thread() is not threading.main_thread():
        current = _zygotes.get(os.getpid())
        return current if current is not None and current.alive() else None
    current = _zygotes.get(os.getpid(), False)
    if current is None or (current and current.alive()):
        return current or None
    try:
        _zygotes[os.getpid()] = Zygote()
    except OSError:
        log.warning("sandbox: no fork server; calls fork from the worker", exc_info=True)
        _zygotes[os.getpid()] = None
    return _zygotes[os.getpid()]


# -- the server ------------------------------------------------------------------------------
def main() -> None:
    from worker.sandbox.libc import _PR_SET_PDEATHSIG, _libc

    worker = int(sys.argv[-1])
    _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != worker:
        return
    sock = socket.socket(fileno=int(os.environ.pop("TOOLOOP_ZYGOTE_FD")))
    _import(pickle.loads(_read(sock, int.from_bytes(_read(sock, 8), "big"))))
    from worker.registry import REGISTRY

    have = pickle.dumps(tool_names(REGISTRY))
    sock.sendall(len(have).to_bytes(8, "big") + have)
    gc.collect()
    gc.freeze()  # the spares' collections never walk (and copy) the server's own objects
    _serve(sock, int(sys.argv[-2]))


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
class _Stocked:
    pid: int
    request_w: int
    result_r: int
    made_at: float


class _Stock:
    """Spares forked ahead of their request (see the module's notes)."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.spares: deque[_Stocked] = deque()
        self.asked: deque[float] = deque()  # when spares were asked for, within WINDOW_S
        self.peak, self.peak_at = 0, 0.0
        self.root = _may_renice()  # a spare forked at nice 19 can take its priority back
        self.nice = os.getpriority(os.PRIO_PROCESS, 0)  # the server's own: a spare's once it has a call

    def wanted(self, now: float) -> int:
        while self.asked and now - self.asked[0] > WINDOW_S:
            self.asked.popleft()
        if len(self.asked) >= self.peak or now - self.peak_at > PEAK_S:
            self.peak, self.peak_at = len(self.asked), now
        return min(self.most, self.peak)

    def fork(self, sock: socket.socket, ahead: bool) -> _Stocked:
        """A spare holding its two pipe ends; ``ahead``: for the stock (niced, when root)."""
        from worker.sandbox.spare_child import fork_spare

        request_r, request_w = os.pipe()
        result_r, result_w = os.pipe()
        others = tuple(fd for s in self.spares for fd in (s.request_w, s.result_r))
        niced = ahead and self.root
        try:
            if niced:
                os.setpriority(os.PRIO_PROCESS, 0, 19)
            pid = fork_spare(request_r, result_w, (sock.fileno(), request_w, result_r, *others),
                             renice=self.nice if niced else None)  # fmt: skip
        except BaseException:
            os.close(request_w)
            os.close(result_r)
            raise
        finally:
            if niced:
                os.setpriority(os.PRIO_PROCESS, 0, self.nice)
            os.close(request_r)
            os.close(result_w)
        return _Stocked(pid, request_w, result_r, time.monotonic())

    def take(self, sock: socket.socket, done: dict[int, int]) -> _Stocked:
        self.asked.append(time.monotonic())
        while self.spares:
            spare = self.spares.popleft()
            if spare.pid not in done and not _doomed(spare.pid):  # (killed while it waited: the next)
                return spare
            self.end(spare)
        return self.fork(sock, ahead=False)

    def end(self, spare: _Stocked) -> None:
        """Close its pipes: it reads the end and exits (reaped as it does)."""
        for fd in (spare.request_w, spare.result_r):
            with contextlib.suppress(OSError):
                os.close(fd)

    def idle(self, sock: socket.socket, done: dict[int, int], since: float) -> float | None:
        """While no request comes: fork one spare for the stock, or end a stale one. The
        time to wait for a request before the next step (None: until one comes)."""
        now = time.monotonic()
        for spare in [s for s in self.spares if s.pid in done or now - s.made_at > STOCK_TTL_S]:
            self.spares.remove(spare)
            self.end(spare)
        if len(self.spares) >= self.wanted(now):
            return STOCK_TTL_S if self.spares else (WINDOW_S if self.asked else None)
        if now - since < IDLE_S:
            return IDLE_S - (now - since)
        try:
            self.spares.append(self.fork(sock, ahead=True))
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


def _may_renice() -> bool:
    """Whether this process may lower a niceness (CAP_SYS_NICE: root, outside Docker's default
    capabilities): only then is the stock forked at nice 19."""
    try:
        with open("/proc/self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:"))
        return bool(int(caps.split()[1], 16) >> 23 & 1)
    except (OSError, StopIteration, ValueError, IndexError):
        return False


def _serve(sock: socket.socket, most: int) -> None:
    done: dict[int, int] = {}
    stock = _Stock(most)
    last = time.monotonic()
    while True:
        wait = stock.idle(sock, done, last) if stock.most else None
        if wait is not None and not select.select([sock], [], [], wait)[0]:
            _reap(done)
            continue
        try:
            frame, fds, _, _ = socket.recv_fds(sock, _FRAME.size, 2)  # (no fds come now: closed)
        except OSError:
            return
        if len(frame) < _FRAME.size:
            return  # the worker is gone
        last = time.monotonic()
        op, arg = _FRAME.unpack(frame)
        _reap(done)
        given: list[int] = []
        try:
            if op == b"S":
                spare = stock.take(sock, done)
                answer, given = spare.pid, [spare.request_w, spare.result_r]
            else:
                answer = done.pop(arg) if arg in done else os.waitpid(arg, 0)[1]
        except OSError as exc:
            answer = -(exc.errno or 5)
        finally:
            for fd in fds:
                os.close(fd)
        try:
            if given:
                socket.send_fds(sock, [_ANSWER.pack(answer)], given)
            else:
                sock.sendall(_ANSWER.pack(answer))
        finally:
            for fd in given:  # the worker holds them now
                os.close(fd)


def _reap(done: dict[int, int]) -> None:
    """Statuses of exited spares, kept until the worker asks (bounded)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        done[pid] = status
        if len(done) > _KEPT_STATUSES:
            done.pop(next(iter(done)))


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise SystemExit(0)
        data += chunk
    return data


if __name__ == "__main__":
    main()
