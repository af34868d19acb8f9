"""Approval-gated calls, the worker's side (the state machine: orchestrator/approvals.py).

The turn marks a gated call in the call it stores (``worker/calls.py``); the call-start
script hands such a call back to the tool task unstarted (``gate``), which asks
``orchestrator.approvals.park`` and runs the call only once a person approved it.
"""

from __future__ import annotations

from typing import Any

from worker.registry import REGISTRY


def gated(spec: Any, name: str, catalog: dict[str, dict[str, Any]]) -> bool:
    """A spec's ``approval`` list, or the tool's own ``@tool(approval=True)``."""
    if name in spec.approval:
        return True
    tool = REGISTRY.get(name)
    if tool is not None:
        return tool.approval
    return bool(catalog.get(name, {}).get("approval"))
