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
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
from typing import Any

log = logging.getLogger(__name__)

_FRAME = struct.Struct("!cq")  # op, argument: b"F" fork a spare (fds attached), b"W" wait for pid
_ANSWER = struct.Struct("!q")
_BOOT = (
    "import os, sys; sys.path[:] = os.environ.pop('TOOLOOP_ZYGOTE_PATH').split(os.pathsep); "
    "from worker.sandbox.zygote import main; main()  # tooloop sandbox fork server"
)
_KEPT_STATUSES = 4096  # exit statuses of processes nobody asked about yet, at most
START_TIMEOUT_S = 60.0  # for the server to import the tool modules (a hung import: no server)


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
        command = [sys.executable, "-c", _BOOT, str(os.getpid())]
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

    def spawn(self, request_r: int, result_w: int) -> int:
        """A spare process, forked by the server, holding these two pipe ends: its pid."""
        with self.lock:
            socket.send_fds(self.sock, [_FRAME.pack(b"F", 0)], [request_r, result_w])
            return self._answer()

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
    _serve(sock)


def _import(modules: list[str]) -> None:
    # What every spare runs, and what unpickling its call needs: imported once, here.
    import orchestrator.models  # noqa: F401
    import worker.sandbox.spare_child  # noqa: F401

    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # that module's tools fork from the worker
            log.warning("sandbox fork server: cannot import %s", module, exc_info=True)


def _serve(sock: socket.socket) -> None:
    from worker.sandbox.spare_child import fork_spare

    done: dict[int, int] = {}
    while True:
        try:
            frame, fds, _, _ = socket.recv_fds(sock, _FRAME.size, 2)
        except OSError:
            return
        if len(frame) < _FRAME.size:
            return  # the worker is gone
        op, arg = _FRAME.unpack(frame)
        _reap(done)
        try:
            if op == b"F":
                request_r, result_w = fds
                answer = fork_spare(request_r, result_w, (sock.fileno(),))
            else:
                answer = done.pop(arg) if arg in done else os.waitpid(arg, 0)[1]
        except OSError as exc:
            answer = -(exc.errno or 5)
        finally:
            for fd in fds:
                os.close(fd)
        sock.sendall(_ANSWER.pack(answer))


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
