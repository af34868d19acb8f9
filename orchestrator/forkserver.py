"""A preloaded interpreter that forks ``tooloop worker`` launchers: for the test suite.

The suite starts a few hundred workers. Each started as a fresh interpreter spends
~7 s of CPU importing the same libraries (litellm alone ~5.5 s): on a 2-core box
that was most of the suite's CPU. This server imports those libraries once per
test process and forks each launcher from itself; the launcher then forks its
pools (``worker/pools.py``), so a worker is up for ~1 s of CPU.

What a forked launcher runs is ``python -m orchestrator.cli worker ...``, as a
fresh one would: in its own session and process group, with the given
environment, folder and log file, stopped (SIGTERM) when this server dies, which
itself dies with the process that started it. Only third-party libraries are
preloaded, never a module of this project (they read settings at import), and a
worker whose environment differs from this server's in anything a library may
read at import (``ForkServer.serves``) starts as a fresh interpreter instead.

Exit statuses: the server reaps its children and writes each one's status to a
file named by its pid and the request's number (a pid may come again), which
``ForkedProcess.poll`` reads.

Protocol: one JSON object per line on a Unix socket: ``{"argv", "env", "cwd",
"log"}`` -> ``{"pid", "seq"}``.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NoReturn

from orchestrator.local import exited, stop_with_parent

# Third-party modules that `tooloop worker`, its CLI and its pools import; none of them
# reads TOOLOOP_* or a provider key at import.
PRELOAD = (
    "typer", "rich.console", "click", "pydantic", "pydantic_settings", "redis", "kombu.transport.redis",
    "kombu.transport.pyamqp", "celery.bin.celery", "celery.apps.worker", "celery.worker.consumer",
    "celery.worker.strategy", "celery.concurrency.prefork", "celery.concurrency.thread", "litellm",
    "litellm.litellm_core_utils.litellm_logging", "setproctitle",
)  # fmt: skip


def _forwardable(name: str) -> bool:
    """Environment variables that may differ between this server and a worker it forks:
    read by tooloop at run time only, never by a preloaded library at import."""
    return name.startswith("TOOLOOP_") or name.endswith("_API_KEY")


# -- the client side (in the test process) ----------------------------------------------
class ForkServer:
    """This process's fork server, started on first use."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="tooloop-forkserver-"))
        self.env = dict(os.environ)
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.forkserver", str(theirs.fileno()), str(self.folder)],
            pass_fds=[theirs.fileno()], env=self.env, preexec_fn=stop_with_parent,
        )  # fmt: skip
        theirs.close()
        self.sock = ours
        self.reader = ours.makefile("r")

    def serves(self, env: dict[str, str], wrap: list[str] | None) -> bool:
        """Whether a worker with ``env`` (the whole of it) may be forked from this server."""
        if wrap or self.proc.poll() is not None:
            return False
        keys = env.keys() | self.env.keys()
        return all(env.get(k) == self.env.get(k) or _forwardable(k) for k in keys)

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None, log: Path) -> ForkedProcess:
        request = {"argv": argv, "env": env, "cwd": cwd or os.getcwd(), "log": str(log)}
        self.sock.sendall(json.dumps(request).encode() + b"\n")
        line = self.reader.readline()
        if not line:
            raise RuntimeError(f"the fork server exited ({self.proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the fork server could not fork: {reply['error']}")
        return ForkedProcess(reply["pid"], self.folder / f"{reply['pid']}-{reply['seq']}", argv)

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        shutil.rmtree(self.folder, ignore_errors=True)


class Forked:
    """A forked process as the suite and the launcher use it: the part of
    ``subprocess.Popen`` they need, over how its exit is learnt (``_exited``)."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid, self.args = pid, args
        self.returncode: int | None = None

    def _exited(self) -> int | None:
        raise NotImplementedError

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._exited()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedProcess(Forked):
    """A launcher the server forked: the server reaped it and wrote its status to a file."""

    def __init__(self, pid: int, status: Path, args: list[str]) -> None:
        super().__init__(pid, args)
        self._status = status

    def _exited(self) -> int | None:
        return int(self._status.read_text()) if self._status.exists() else None


# -- the server side ----------------------------------------------------------------------
_spawned: dict[int, int] = {}  # pid -> the request's number, until reaped


def serve(fd: int, folder: Path) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # as tooloop sets it: no fetch at import
    for name in PRELOAD:
        with contextlib.suppress(Exception):  # a missing optional library: the worker says so itself
            importlib.import_module(name)
    gc.collect()
    gc.freeze()  # the workers' collections never walk (and so copy) what was imported here
    signal.signal(signal.SIGCHLD, lambda *_: _reap(folder))
    sock = socket.socket(fileno=fd)
    reader = sock.makefile("r")
    for seq, line in enumerate(reader, 1):
        request = json.loads(line)
        try:
            reply: dict[str, object] = {"pid": _fork(request, seq, fd), "seq": seq}
        except OSError as exc:
            reply = {"error": str(exc)}
        sock.sendall(json.dumps(reply).encode() + b"\n")


def _reap(folder: Path) -> None:
    for pid, status in exited():
        name = f"{pid}-{_spawned.pop(pid, 0)}"
        done = folder / f"{name}.tmp"
        done.write_text(str(os.waitstatus_to_exitcode(status)))
        done.rename(folder / name)


def _fork(request: dict, seq: int, fd: int) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # reaped only once its number is known
    try:
        pid = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        raise
    if pid:
        _spawned[pid] = seq
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        return pid
    try:
        os.close(fd)  # the test process's socket is not the worker's
        os.setsid()
        stop_with_parent()
        _redirect(request["log"])
    except BaseException:
        os._exit(1)
    _, module, *args = request["argv"]  # ["-m", module, args...]
    become(module, args, request["env"], request["cwd"])


def become(module: str, args: list[str], env: dict[str, str], folder: str) -> NoReturn:
    """In a child just forked from a preloaded interpreter: run ``python -m module args`` in
    ``folder`` with ``env`` as a fresh interpreter would, then exit with its code (never
    return into the code that forked). Also used by ``worker/pools.py``."""
    code = 1
    try:
        _retitle(f"{sys.executable} -m {module} {' '.join(args)}")  # ps shows what a fresh one would
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):  # the parent's handlers are not ours
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        os.chdir(folder)
        for name in set(os.environ) - set(env):
            del os.environ[name]
        os.environ.update(env)
        _forget_settings()
        sys.argv = [module, *args]
        sys.path[0] = os.getcwd()  # `python -m` puts the current folder first
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # never return into the forking code
        traceback.print_exc()
    finally:
        # What a fresh interpreter's exit would do (multiprocessing's temporary folders,
        # logging's flush...); SystemExit would instead unwind through the parent's frames.
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _forget_settings() -> None:
    """The parent read its settings from its own environment (the launcher: without the
    ``--tools`` it adds for its pools): the child reads them again from its own."""
    settings = sys.modules.get("orchestrator.settings")
    if settings is not None:
        settings.get_settings.cache_clear()


def _retitle(title: str) -> None:
    """Name the process for ps and pgrep (Celery renames its own once it runs). Done before the
    environment is touched: setproctitle cannot find its room once environ was rebuilt."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def _redirect(log: str) -> None:
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)


if __name__ == "__main__":
    serve(int(sys.argv[1]), Path(sys.argv[2]))
