"""``add`` as a tooloop tool: ``TOOLOOP_TOOLS=bench.peers.tools``.

Not idempotent (the default): after a kill -9 during the call, tooloop does not run it
again (bench/peers/loop.py records each execution in the run's folder)."""

from __future__ import annotations

from bench.peers.loop import add_recorded
from worker import tool


@tool
def add(a: int, b: int, sandbox_root: str) -> int:
    """Add two integers."""
    return add_recorded(a, b, sandbox_root)
