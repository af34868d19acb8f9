"""CPU time, RSS and the machine, read from /proc (Linux): no extra dependency.

A worker is a tree: the ``tooloop worker`` launcher, one Celery worker per pool,
the prefork pool's children, and the sandbox's short-lived forks. A process's own
CPU (utime + stime) plus what it collected from children it reaped (cutime +
cstime) counts every one of them, the forks that are gone included.
"""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass

TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Proc:
    pid: int
    ppid: int
    name: str
    cpu_s: float  # own user + sys
    reaped_s: float  # user + sys of children it waited for
    rss: int  # bytes
    cmdline: str


def read(pid: int) -> Proc | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()  # fields[0] is field 3 (state)
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    rss_pages = int(fields[21])
    own = (utime + stime) / TICK
    if int(fields[17]) == 1:  # one thread: its time in ns. /proc/<pid>/stat rounds each process
        try:  # down to a tick (10 ms), and hundreds of waiting call processes would add up
            with open(f"/proc/{pid}/schedstat") as f:
                own = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            pass
    return Proc(pid, int(fields[1]), name, own, (cutime + cstime) / TICK, rss_pages * PAGE, cmd)


def tree(root: int) -> list[Proc]:
    """``root`` and every live descendant."""
    procs = [p for p in (read(int(d)) for d in os.listdir("/proc") if d.isdigit()) if p]
    children: dict[int, list[Proc]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p)
    top = next((p for p in procs if p.pid == root), None)
    out, todo = [], [top] if top else []
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p.pid, [])
    return out


def cpu_of_tree(root: int) -> float:
    """CPU seconds of the tree so far: live processes and the children they reaped."""
    return sum(p.cpu_s + p.reaped_s for p in tree(root))


def cpu_of(pid: int) -> float:
    p = read(pid)
    return p.cpu_s if p else 0.0


def machine(redis_client) -> list[str]:
    import celery
    import kombu
    import redis

    try:
        from importlib.metadata import version

        litellm = version("litellm")
    except Exception:
        litellm = "?"
    server = redis_client.info("server").get("redis_version", "?")
    model = _cpu_model()
    return [
        f"machine: {os.cpu_count()} cores ({model}), Linux {platform.release()}",
        f"  Python {platform.python_version()}, Celery {celery.__version__}, kombu {kombu.__version__}, "
        f"redis-py {redis.__version__}, Redis {server}, litellm {litellm}",
    ]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} (1 / 5 min) at start: other work on the box skews wall times"


def git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip()  # fmt: skip
    except Exception:
        return "?"
