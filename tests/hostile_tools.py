"""Tools a hostile model would love: each one tries an escape (see tests/test_sandbox.py).

Every tool is registered twice: ``name`` (the default, forked layer) and
``name_strict`` (``@tool(sandbox="strict")``: bubblewrap where it works).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

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
        "sid": os.getsid(0),
    }  # fmt: skip


@_both
def append_text(name: str, text: str) -> str:
    """Append to a file of the run's folder (relative path): calls of a run share it."""
    with open(name, "a") as f:
        f.write(text)
    with open(name) as f:
        return f.read()
