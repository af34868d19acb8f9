"""A stored tool call as the control plane reads it (its three shapes: worker/calls.py):
what its task's message carries, and the id its tool message answers."""

from __future__ import annotations

from typing import Any

# What a tool task's message carries of its stored call: which call, and its tool.
MESSAGE_FIELDS = ("run_id", "iteration", "index", "key", "call_id", "tool")


def message(stored: dict[str, Any]) -> dict[str, Any]:
    """What the tool task's message carries: which call, and its tool's name."""
    return {name: stored[name] for name in MESSAGE_FIELDS if name in stored}


def model_call_id(payload: dict[str, Any]) -> str:
    """The id the model gave the call (its tool message answers that one); the record and
    approvals use ``call_id``, the call's own in the run (they differ when the model repeated an id)."""
    return payload.get("model_call_id") or payload["call_id"]
