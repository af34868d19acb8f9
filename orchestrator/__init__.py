"""tooloop's control plane: specs and results, the run store, the producer client."""

from orchestrator.client import Client, RunHandle, load_spec
from orchestrator.models import Exit, RunResult, RunSpec, Status, ToolCallRecord
from orchestrator.validation import SpecError

__all__ = [
    "Client",
    "Exit",
    "RunHandle",
    "RunResult",
    "RunSpec",
    "SpecError",
    "Status",
    "ToolCallRecord",
    "load_spec",
]
