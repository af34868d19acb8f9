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


@tool(idempotent=True)
def slow_lookup(key: str, seconds: float) -> str:
    """Idempotent: sleep, then return the key upper-cased."""
    time.sleep(seconds)
    return key.upper()
