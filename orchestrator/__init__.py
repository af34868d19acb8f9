"""tooloop's control plane: specs and results, the run store, the producer client.

The names below are imported on first use: a process that needs one module of this
package (the sandbox's fork server, the CLI) does not load the client, the run store
and Redis with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.client import Client, RunHandle, load_spec
    from orchestrator.fork import ForkError
    from orchestrator.models import Exit, RunResult, RunSpec, Status, ToolCallRecord
    from orchestrator.validation import SpecError

_WHERE = {
    "Client": "orchestrator.client",
    "RunHandle": "orchestrator.client",
    "load_spec": "orchestrator.client",
    "Exit": "orchestrator.models",
    "RunResult": "orchestrator.models",
    "RunSpec": "orchestrator.models",
    "Status": "orchestrator.models",
    "ToolCallRecord": "orchestrator.models",
    "SpecError": "orchestrator.validation",
    "ForkError": "orchestrator.fork",
}

__all__ = [
    "Client",
    "Exit",
    "ForkError",
    "RunHandle",
    "RunResult",
    "RunSpec",
    "SpecError",
    "Status",
    "ToolCallRecord",
    "load_spec",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
