"""Tools a hostile model would love: each one tries an escape (see tests/test_sandbox.py).

Every tool is registered twice: ``name`` (the default, forked layer) and
``name_strict`` (``@tool(sandbox="strict")``: bubblewrap where it works).
"""

from __future__ import annotations

import contextlib
import encodings.idna  # noqa: F401  (socket needs it; outside bwrap a call's uid may not read Python lazily)
import os
import resource
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

from tests.sandbox_probe import battery
from worker import tool


def _both(fn: Callable[..., Any]) -> Callable[..., Any]:
    tool(fn)
    tool(name=f"{fn.__name__}_strict", sandbox="strict")(fn)
    return fn


@_both
def write_path(path: str, text: str) -> str:
    """Write a file anywhere."""
    with open(path, "w") as f:
        f.write(text)
    return "written"


@_both
def read_path(path: str) -> str:
    """Read a file anywhere."""
    with open(path) as f:
        return f.read()


@_both
def list_path(path: str) -> list[str]:
    """List a folder anywhere."""
    return sorted(os.listdir(path))


@_both
def connect(host: str, port: int) -> str:
    """Open a TCP connection and say PING (Redis answers +PONG)."""
    with socket.create_connection((host, port), timeout=3) as s:
        s.sendall(b"PING\r\n")
        return s.recv(64).decode()


@_both
def environment() -> dict:
    """The whole environment, looking for keys."""
    return dict(os.environ)


@_both
def c_environment() -> list[str]:
    """The C library's own copy of the environment (``environ``), which a C extension's
    ``setenv`` changes behind ``os.environ``'s back, and which programs started without an
    explicit environment inherit."""
    import ctypes

    block = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    out, n = [], 0
    while block and block[n] is not None:
        out.append(block[n].decode(errors="replace"))
        n += 1
    return out


@_both
def proc_environ() -> str:
    """The environment block as the kernel keeps it (a forked process keeps its parent's)."""
    with open("/proc/self/environ", "rb") as f:
        return f.read().decode(errors="replace")


@_both
def inherited_fds() -> dict:
    """Every open descriptor and what it points at (a socket would be the worker's)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed already
            out[name] = os.readlink(f"/proc/self/fd/{name}")
    return out


@_both
def use_inherited_sockets() -> list[str]:
    """Say PING on every inherited socket: a Redis connection would answer."""
    replies = []
    for fd in range(3, 1024):
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.settimeout(1)
            s.sendall(b"PING\r\n")
            replies.append(s.recv(64).decode(errors="replace"))
        except OSError:
            pass
        finally:
            s.detach()
    return replies


@_both
def allocate(gib: float) -> int:
    """Allocate (and touch) a lot of memory."""
    block = bytearray(int(gib * (1 << 30)))
    return len(block)


@_both
def fork_bomb(limit: int, seconds: float) -> dict:
    """Fork until refused (at most ``limit`` times); every child sleeps."""
    forks = 0
    for _ in range(limit):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(seconds)
            os._exit(0)
        forks += 1
    return {"forks": forks, "uid": os.getuid()}


@_both
def escape(marker: str, wait: float) -> dict:
    """Start ``sleep <marker>`` in a new session, twice forked (out of our process group
    and re-parented), then maybe wait ourselves; the sleeper should outlive the call."""
    subprocess.run(["/bin/sh", "-c", f"setsid sleep {marker} >/dev/null 2>&1 &"], check=True)
    subprocess.Popen(["sleep", marker], start_new_session=True)
    time.sleep(wait)
    return {"uid": os.getuid(), "marker": marker, "seen": _count(marker)}


def _count(marker: str) -> int:
    """Processes whose command line holds ``marker`` (as this call sees /proc)."""
    seen = 0
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError), open(f"/proc/{name}/cmdline", "rb") as f:
            seen += marker.encode() in f.read().split(b"\0")
    return seen


@_both
def ignore_sigterm(marker: str, seconds: float) -> str:
    """Ignore SIGTERM (and have a child that does too), then sit."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen(["/bin/sh", "-c", f"trap '' TERM; sleep {marker}"])
    time.sleep(seconds)
    return "still here"


@_both
def segfault() -> str:
    """Write to address 0 from C code: the process dies on SIGSEGV (a crashing C extension)."""
    import ctypes

    ctypes.memset(0, 1, 1)
    return "still here"


@_both
def burn_cpu(seconds: float) -> str:
    """Spin."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return "done"


@_both
def big_file(mb: int) -> int:
    """Write ``mb`` MiB into the run's folder."""
    with open("big.bin", "wb") as f:
        for _ in range(mb):
            f.write(b"x" * (1 << 20))
    return mb


@_both
def identity() -> dict:
    """Who and where the call runs, with its limits."""
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    limits = {name: resource.getrlimit(getattr(resource, name))
              for name in ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_NPROC",
                           "RLIMIT_CORE")}  # fmt: skip
    return {
        "uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
        "cwd": os.getcwd(), "pid": os.getpid(), "hostname": socket.gethostname(),
        "no_new_privs": status["NoNewPrivs"].strip(), "limits": limits,
        "sid": os.getsid(0), "ppid": os.getppid(), "nice": os.getpriority(os.PRIO_PROCESS, 0),
    }  # fmt: skip


@_both
def imported(names: list[str]) -> list[str]:
    """Which of ``names`` the call's process has loaded (what it inherited of its parent)."""
    import sys

    return [name for name in names if name in sys.modules]


@_both
def append_text(name: str, text: str) -> str:
    """Append to a file of the run's folder (relative path): calls of a run share it."""
    with open(name, "a") as f:
        f.write(text)
    with open(name) as f:
        return f.read()


@_both
def worker_secrets() -> dict:
    """Look for the worker's secrets where a forked call inherited them: its settings, its
    store's and Celery's connection details, the sealing key's Fernet objects; and every
    object of those kinds left anywhere in the heap."""
    import gc
    import sys

    texts: list[str] = []
    modules = sys.modules
    if "orchestrator.settings" in modules:
        texts.append(repr(modules["orchestrator.settings"].get_settings().__dict__))
    if "worker.app" in modules:
        app = modules["worker.app"].app
        texts += [repr(getattr(app, "tooloop_settings", None).__dict__), str(app.conf.broker_url),
                  str(app.conf.result_backend)]  # fmt: skip
        try:
            texts.append(repr(modules["worker.app"].get_store().redis.connection_pool.connection_kwargs))
        except Exception as exc:  # its URL is gone: no store can be made
            texts.append(f"no store: {exc}")
    kinds = ("Settings", "ConnectionPool", "Connection", "RedisBackend", "Fernet", "Celery")
    fernets = 0
    for obj in gc.get_objects():
        kind = type(obj).__name__
        if kind in kinds:
            fernets += kind == "Fernet"
            texts.append(_shown(obj))
    return {"text": "\n".join(texts), "fernets": fernets}


def _shown(obj: Any) -> str:
    """An object's fields as text; some reprs fail in the fork (an AMQP transport asks its
    socket, now /dev/null, for its address: ENOTSOCK), so each field is shown on its own."""
    # a copy: showing a field may set another (a Celery app fills its cached properties)
    fields = dict(vars(obj)) if hasattr(obj, "__dict__") else {"": obj}
    shown = []
    for name, value in fields.items():
        try:
            shown.append(f"{name}={value!r}")
        except Exception as exc:
            shown.append(f"{name}=<{type(value).__name__}: {exc}>")
    return ", ".join(shown)


@_both
def fill_disk(files: int, mb: int, pause: float = 0.0) -> int:
    """Write ``files`` files of ``mb`` MiB each into the run's folder, ``pause`` s apart."""
    for n in range(files):
        with open(f"fill-{n}.bin", "wb") as f:
            for _ in range(mb):
                f.write(b"\1" * (1 << 20))
        time.sleep(pause)
    return files * mb


@_both
def open_until_refused(limit: int = 5000) -> dict:
    """Open /dev/null until the kernel says no (or ``limit``): how many more the call got."""
    held, error = [], ""
    try:
        while len(held) < limit:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError as exc:
        error = exc.strerror or str(exc)
    for fd in held:
        os.close(fd)
    return {"opened": len(held), "error": error}


@tool(sandbox="strict")
def probe_strict(targets: dict) -> dict:
    """A hostile tool's attempts, in a fresh interpreter (tests/sandbox_probe.py)."""
    return battery(targets)


_leaked: list[Any] = []  # what a call leaves in its process for the next one


@_both
def leave_thread(seconds: float) -> int:
    """Start a thread that outlives the call (its process must not serve another)."""
    import threading

    threading.Thread(target=time.sleep, args=(seconds,), daemon=True).start()
    return os.getpid()


@_both
def leak_file(name: str) -> int:
    """Open a file in the run's folder and keep it open after the call."""
    _leaked.append(open(name, "w"))  # noqa: SIM115
    return os.getpid()


@_both
def wander(value: str) -> dict:
    """Leave the run's folder and change the environment: the next call must not see either."""
    seen = {"pid": os.getpid(), "cwd": os.getcwd(), "env": os.environ.get("WANDERED")}
    os.chdir("/")
    os.environ["WANDERED"] = value
    os.umask(0o000)
    return seen


@_both
def hold_memory(mb: int) -> int:
    """Keep ``mb`` MiB (touched) in the process after the call."""
    _leaked.append(b"x" * (mb << 20))
    return os.getpid()
