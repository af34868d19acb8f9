"""Tools the test workers register (TOOLOOP_TOOLS=tests.tools)."""

from __future__ import annotations

import os
import sys
import time

from worker import tool


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool(name="sleepy")
def sleep_for(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return f"slept {seconds}"


@tool
def boom(message: str) -> str:
    """Always raises."""
    raise RuntimeError(message)


@tool
def where(sandbox_root: str, resource_bindings: dict) -> dict:
    """Report the injected context."""
    return {"sandbox_root": sandbox_root, "cwd": os.getcwd(), "bindings": resource_bindings}


@tool
def odd_output() -> object:
    """Returns something that is not JSON."""
    return {1, 2}


@tool
def append_line(text: str, sandbox_root: str) -> int:
    """Append a line to effects.txt in the run's folder (a non-idempotent effect)."""
    with open(os.path.join(sandbox_root, "effects.txt"), "a") as f:
        f.write(text + "\n")
    with open(os.path.join(sandbox_root, "effects.txt")) as f:
        return sum(1 for _ in f)


@tool(idempotent=True)
def lookup(key: str) -> str:
    """Idempotent read."""
    return key.upper()


@tool
def modules() -> list[str]:
    """Which heavy modules the tool process has imported."""
    return sorted(m for m in ("litellm", "openai") if m in sys.modules)


@tool
def pid_sleeper(seconds: float, sandbox_root: str) -> str:
    """Write this process's pid to pid.txt in the run's folder, then sleep."""
    with open(os.path.join(sandbox_root, "pid.txt"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(seconds)
    return "woke up"


@tool
def append_then_sleep(text: str, seconds: float, sandbox_root: str) -> int:
    """Append `text` to effects.txt (a non-idempotent effect), then sleep."""
    with open(os.path.join(sandbox_root, "effects.txt"), "a") as f:
        f.write(text + "\n")
    time.sleep(seconds)
    return 1


@tool
def effect_where(text: str, seconds: float, sandbox_root: str) -> str:
    """Append `text` to effects.txt (a non-idempotent effect), sleep, and say where it ran:
    the worker's sandbox root (each host of tests/test_hosts.py has its own)."""
    with open(os.path.join(sandbox_root, "effects.txt"), "a") as f:
        f.write(text + "\n")
    time.sleep(seconds)
    return os.path.dirname(sandbox_root)


@tool(idempotent=True)
def slow_lookup(key: str, seconds: float) -> str:
    """Idempotent: sleep, then return the key upper-cased."""
    time.sleep(seconds)
    return key.upper()


@tool
def big_output(chars: int) -> str:
    """Return a string of `chars` characters: HEAD, x's, TAIL."""
    return "HEAD" + "x" * max(0, chars - 8) + "TAIL"


@tool
def big_rows(count: int) -> dict:
    """Return an object holding `count` small rows."""
    return {"rows": [{"id": i, "name": f"row {i}"} for i in range(count)], "count": count}


LEAKED = {
    "api_key": "sk-live-4f9a8b7c6d5e4f3a2b1c",
    "password": "hunter2hunter2",
    "github": "ghp_0123456789abcdefghijABCDEFGHIJ",
    "aws": "AKIAIOSFODNN7EXAMPLE",
    "bearer": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
}


@tool
def leaky() -> dict:
    """Return credentials, as a careless tool would."""
    return {
        "config": {"api_key": LEAKED["api_key"], "retries": 3},
        "log": f"connecting with password={LEAKED['password']} and token {LEAKED['github']}",
        "env": f"AWS_ACCESS_KEY_ID={LEAKED['aws']}\nAuthorization: Bearer {LEAKED['bearer']}",
        "count": 3,
    }


@tool
def secret_number() -> int:
    """An int output stays an int after scrubbing."""
    return 42


@tool
def fingerprint(text: str, seconds: float = 0) -> str:
    """The SHA-256 of `text` (shows which text the tool received), after sleeping."""
    import hashlib

    time.sleep(seconds)
    return hashlib.sha256(text.encode()).hexdigest()


@tool(idempotent=True)
def count(n: int, pad: int = 0) -> dict:
    """Return n + 1, padded with `pad` characters (a tool output of some size)."""
    return {"n": n + 1, "pad": "p" * pad}


@tool(approval=True)
def guarded_append(text: str, sandbox_root: str) -> int:
    """Append a line to effects.txt, once a person approved the call."""
    with open(os.path.join(sandbox_root, "effects.txt"), "a") as f:
        f.write(text + "\n")
    with open(os.path.join(sandbox_root, "effects.txt")) as f:
        return sum(1 for _ in f)


@tool(idempotent=True)
def tagged_sleep(seconds: float, sandbox_root: str) -> int:
    """Idempotent: mark the start (started-<pid>), sleep, mark the end; returns the pid."""
    pid = os.getpid()
    open(os.path.join(sandbox_root, f"started-{pid}"), "w").close()
    time.sleep(seconds)
    open(os.path.join(sandbox_root, f"done-{pid}"), "w").close()
    return pid


@tool
def wait_for_file(name: str, sandbox_root: str, seconds: float = 60) -> str:
    """Return once ``name`` exists in the run's folder: a test's gate on a running call."""
    path, deadline = os.path.join(sandbox_root, name), time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} never came")
        time.sleep(0.02)
    return name


@tool(idempotent=True)
def read_note(path: str) -> str:
    """Read a text file (a world-readable one the replay tests change between a run and its replay)."""
    with open(path) as f:
        return f.read()
