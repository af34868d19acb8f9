"""The fork server: forked calls start from a small process, not from the worker.

Forking the tool worker (a ~76 MB Celery pool process) for every call cost ~20 ms of
CPU per call here, most of it in the kernel: copying and tearing down its page tables,
and the copy-on-write faults of every page the worker then writes while the call's
process shares them (measured: tool pool CPU per tool-turn 27 ms with the fork, 6 ms
with the call run in-process; ``docs/benchmarks.md``). So calls' processes are forked by
a fork server (``fork_server.py``): a fresh interpreter that imports the worker's tool
modules and the sandbox, and nothing of Celery, Redis or the settings, with the
environment allowlist alone (``env.py``): nothing of the worker's is in its memory. The
worker keeps watching, killing and decoding each call as before, and asks the server
for the exit status of the processes it forked.

**One server per tools pool.** The pool's main process starts it before it forks its
processes (``start_hub``); each of them connects to it as it starts (``start_early``).
Before, each pool process started its own: 16 fresh interpreters per `tooloop worker -c
16`, ~3 s of the ~7 s of CPU a worker's start took (0.2 s each), and a run's kept process
(``reuse.py``) served its next call only if the same pool process took that call. A
process without a pool's server (the test suite's, ``tooloop run``'s) starts one of its
own on first use, as does a pool process whose server died.

A tool the server did not import the same way (defined in ``__main__``, registered
after the server started) is forked from the worker, as before.

With ``TOOLOOP_SANDBOX_STOCK=N`` the server keeps a stock of spares, forked while no
request comes, as many as it was asked for lately, at most N. Calls arrive in bursts
(every run's model answers at about the same time): the fork and the spare's start
(~1.8 ms of CPU of the ~4-5 ms a call's process costs) are then paid between the bursts.
A server that may take a priority back (CAP_SYS_NICE) forks its stock at nice 19, and
each spare takes the server's priority back when it is handed its call. Off by default
(0): in ``bench/concurrency.py`` (100 and 500 runs, load 10-17) no gain in efficiency could
be told from the load's noise, while the stock forked and not used (at the end of a
burst) added ~1-1.5 ms of CPU per call (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from typing import Any

from worker.sandbox.fork_server import ANSWER, FRAME, TAKEN, exactly, tool_names
from worker.sandbox.polling import readable

log = logging.getLogger(__name__)

_BOOT = (
    "import os, sys; sys.path[:] = os.environ.pop('TOOLOOP_ZYGOTE_PATH').split(os.pathsep); "
    "from worker.sandbox.fork_server import main; main()  # tooloop sandbox fork server"
)
START_TIMEOUT_S = 60.0  # for the server to import the tool modules (a hung import: no server)
DEFAULT_STOCK = 0  # spares forked ahead at most (TOOLOOP_SANDBOX_STOCK; off: see the notes)
DEFAULT_KEPT = 512  # processes kept for their runs' next calls, per server (TOOLOOP_SANDBOX_REUSE)
KEEP_IDLE_S = 10.0  # a kept process unused for this long ends


def _setting(name: str, default: int) -> int:
    try:
        return max(0, int(os.environ.get(name, default)))
    except ValueError:
        return default


def stock_size() -> int:
    """Spares a fork server forks ahead, at most (``TOOLOOP_SANDBOX_STOCK``; 0: none)."""
    return _setting("TOOLOOP_SANDBOX_STOCK", DEFAULT_STOCK)


def kept_most() -> int:
    """Processes a fork server keeps for their runs (``TOOLOOP_SANDBOX_REUSE``; 0: no reuse)."""
    return _setting("TOOLOOP_SANDBOX_REUSE", DEFAULT_KEPT)


def enabled() -> bool:
    return os.environ.get("TOOLOOP_SANDBOX_FORK_SERVER", "1") != "0"


class Hub:
    """A fork server this process started, and the control socket every process of its
    pool inherits (each sends the end of a connection of its own through it)."""

    def __init__(self) -> None:
        from worker.registry import REGISTRY
        from worker.sandbox.env import base_environment

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The allowlist alone (worker/sandbox/env.py): every forked call is a copy of the
        # server, so nothing of the worker's environment (keys, passwords, URLs) is in it.
        env = base_environment()
        modules = sorted({where.split(":")[0] for where in tool_names(REGISTRY).values()})
        env.update(TOOLOOP_ZYGOTE_FD=str(theirs.fileno()), TOOLOOP_ZYGOTE_PATH=os.pathsep.join(sys.path),
                   TOOLOOP_ZYGOTE_MODULES=json.dumps(modules))  # fmt: skip
        command = [sys.executable, "-c", _BOOT, str(stock_size()), str(kept_most()), str(KEEP_IDLE_S),
                   str(os.getpid())]  # fmt: skip
        try:
            self.proc = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                         env=env)  # fmt: skip
        finally:
            theirs.close()
        self.control, self.owner, self.pid = ours, os.getpid(), self.proc.pid

    def reachable(self) -> bool:
        """Started by this process, or by its parent (a pool process reaches its pool's)."""
        return self.owner in (os.getpid(), os.getppid())

    def alive(self) -> bool:
        if self.owner == os.getpid():
            return self.proc.poll() is None
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return False

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.control.close()
        if self.owner == os.getpid():
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()


class Zygote:
    """This process's connection to a fork server (one request and its answer at a time)."""

    def __init__(self, hub: Hub) -> None:
        from worker.registry import REGISTRY

        os.close(os.pidfd_open(os.getpid()))  # the worker watches the server's calls by pidfd
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            socket.send_fds(hub.control, [b"C"], [theirs.fileno()])
        finally:
            theirs.close()
        self.hub, self.sock, self.pid = hub, ours, hub.pid
        self.lock = threading.Lock()
        self._wanted = tool_names(REGISTRY)
        self._tools: set[str] | None = None  # its answer: read when first asked (``tools``)

    @property
    def tools(self) -> set[str]:
        """The tools it runs: those it imported as this process did. Asked when first needed,
        so that a server started early imports meanwhile; a server that does not answer
        runs none (its calls fork from the worker)."""
        with self.lock:
            if self._tools is None:
                try:
                    self.sock.settimeout(START_TIMEOUT_S)
                    self.sock.sendall(FRAME.pack(b"H", 0))
                    size = int.from_bytes(self._exactly(8), "big")
                    have: dict[str, str] = pickle.loads(self._exactly(size))
                    self.sock.settimeout(None)
                except (OSError, EOFError, pickle.UnpicklingError):
                    log.warning("sandbox: the fork server did not start; calls fork from the worker",
                                exc_info=True)  # fmt: skip
                    have = {}
                self._tools = {name for name, where in self._wanted.items() if have.get(name) == where}
            return self._tools

    def alive(self) -> bool:
        """The connection holds: between requests a readable socket is a closed one (the
        server never speaks unasked; a server that died closed its end)."""
        if not self.lock.acquire(blocking=False):
            return True  # a request in flight on another thread
        try:
            return not readable([self.sock], 0)
        except (OSError, ValueError):
            return False
        finally:
            self.lock.release()

    def take(self) -> tuple[int, int, int]:
        """A spare process: from the server's stock, or forked now. (pid, the end of its
        request pipe, the end of its result pipe)."""
        with self.lock:
            self.sock.sendall(FRAME.pack(b"S", 0))
            pid, _, fds = self._taken()
            if not pid or len(fds) != 2:
                raise OSError(5, "the fork server gave no process")
            return pid, fds[0], fds[1]

    def take_kept(self, run_id: str, key: str) -> tuple[int, int, int, int] | None:
        """The run's kept process if it fits ``key``: (pid, its uid, its two pipe ends)."""
        with self.lock:
            self._send(b"R", (run_id, key))
            pid, uid, fds = self._taken()
            return (pid, uid, fds[0], fds[1]) if pid and len(fds) == 2 else None

    def keep(self, run_id: str, key: str, uid: int, pid: int, fds: tuple[int, int]) -> None:
        """Give the process (and its pipe ends: closed here) to the server for the run."""
        try:
            with self.lock:
                self._send(b"K", (run_id, key, uid, pid), fds)
                self._answer()
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def wait(self, pid: int) -> int:
        """The exit status of a process this server forked (it must be ending: killed or done)."""
        with self.lock:
            self.sock.sendall(FRAME.pack(b"W", pid))
            return self._answer()

    def forget(self, run_id: str | None) -> None:
        with self.lock:
            self._send(b"F", run_id or "")
            self._answer()

    def kept_pid(self, run_id: str) -> int | None:
        with self.lock:
            self._send(b"Q", run_id)
            return self._answer() or None

    def stop(self) -> None:
        """Close the connection, and stop the server if this process started it."""
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.hub.owner == os.getpid():
            self.hub.stop()

    def _send(self, op: bytes, payload: Any, fds: tuple[int, ...] = ()) -> None:
        data = pickle.dumps(payload)
        frame = FRAME.pack(op, len(data))
        if fds:
            socket.send_fds(self.sock, [frame], list(fds))
        else:
            self.sock.sendall(frame)
        self.sock.sendall(data)

    def _taken(self) -> tuple[int, int, list[int]]:
        data, fds, _, _ = socket.recv_fds(self.sock, TAKEN.size, 2)
        if not data:
            raise OSError("the sandbox's fork server is gone")
        if len(data) < TAKEN.size:
            data += self._exactly(TAKEN.size - len(data))
        pid, uid = TAKEN.unpack(data)
        return pid, uid, fds

    def _answer(self) -> int:
        (value,) = ANSWER.unpack(self._exactly(ANSWER.size))
        if value < 0:
            raise OSError(-value, os.strerror(-value))
        return value

    def _exactly(self, n: int) -> bytes:
        return exactly(self.sock, n)


_hub: Hub | None = None  # the server this process started (or its parent did, before forking it)
_zygotes: dict[int, Zygote | None] = {}  # process pid -> its connection (None: unavailable)


def start_hub() -> None:
    """The tools pool's main process, before it forks its processes: their fork server."""
    global _hub
    if not enabled():
        return
    try:
        _hub = Hub()
    except OSError:
        log.warning("sandbox: no fork server for the pool; each process starts its own", exc_info=True)


def start_early() -> None:
    """Connect to the fork server now (a tool pool process, as it starts), so the server
    imports the tool modules while the worker is still starting. Started on first use
    instead, a fresh worker's first calls each waited for one, and a run whose step was
    sent again to a new worker stood still that much longer (``bench/chaos.py``)."""
    if enabled() and os.getpid() not in _zygotes:
        for_this_process()


def for_this_process() -> Zygote | None:
    """This process's connection to its fork server: its pool's, else one of its own,
    started on first use (and again if it died). A server is started only from the main
    thread: it dies with the thread that started it (PR_SET_PDEATHSIG)."""
    global _hub
    current = _zygotes.get(os.getpid(), False)
    if current is None or (current and current.alive()):
        return current or None
    if threading.current_thread() is not threading.main_thread():
        return None
    if current:
        current.stop()
    try:
        if _hub is None or not _hub.reachable() or not _hub.alive():
            if _hub is not None and _hub.owner == os.getpid():
                _hub.stop()
            _hub = Hub()
        _zygotes[os.getpid()] = Zygote(_hub)
    except OSError:
        log.warning("sandbox: no fork server; calls fork from the worker", exc_info=True)
        _zygotes[os.getpid()] = None
    return _zygotes[os.getpid()]


def restart() -> Zygote | None:
    """A new server for this process (tests: one that sees the environment as it is now)."""
    global _hub
    current = _zygotes.pop(os.getpid(), None)
    if current is not None:
        current.stop()
    if _hub is not None and _hub.owner == os.getpid():
        _hub.stop()
    _hub = None
    return for_this_process()
