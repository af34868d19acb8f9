"""Small helpers shared by the test modules."""

from __future__ import annotations

import threading
import time
from typing import Any


def wait_for(predicate, timeout: float = 15, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not reached in time")


def call(name: str, arguments: object = None, call_id: str | None = None) -> dict:
    """One tool call of a scripted model step."""
    out = {"name": name, "arguments": {} if arguments is None else arguments}
    if call_id:
        out["id"] = call_id
    return out


def tools(*calls: dict, **extra: Any) -> dict:
    """A scripted model step that calls tools (``extra``: delay, tokens, hold...)."""
    return {"tool_calls": list(calls), **extra}


def gate(holds: list[threading.Event]) -> threading.Event:
    """An event that keeps a scripted step waiting; the ``holds`` fixture releases it."""
    event = threading.Event()
    holds.append(event)
    return event
