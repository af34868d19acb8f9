"""What ``run_call`` is given (``SandboxContext``) and gives back (``CallOutcome``), and
the error of a call refused before any tool code runs (``SandboxError``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.models import SandboxPolicy


@dataclass
class CallOutcome:
    ok: bool
    output: Any = None
    error: str | None = None  # "<type>: <message>", fed back to the model
    duration_ms: float = 0.0


@dataclass
class SandboxContext:
    workdir: str
    timeout_s: float
    policy: SandboxPolicy
    on_tick: Callable[[], bool] = lambda: True  # False: stop the call now (abort)
    strict: bool = False  # the strongest layer available (built-ins, @tool(sandbox="strict"))
    mode: str | None = None  # auto | bwrap | basic; None: TOOLOOP_SANDBOX
    sandbox_root: str | None = None  # parent of all run folders; None: TOOLOOP_SANDBOX_ROOT
    run_id: str | None = None  # whose folder ``workdir`` must be (None: any plain name under the root)
    allow: tuple[str, ...] | None = None  # other roots of run folders; None: TOOLOOP_SANDBOX_ALLOW
    # True: return as soon as the result is in; reaping (and forking the next call's
    # process) waits for settle(). False: nothing of the call survives run_call.
    defer_cleanup: bool = False


class SandboxError(Exception):
    """The call cannot be run as asked (refused before any tool code runs)."""


def jsonable(value: Any) -> Any:
    """Outputs are JSON values; anything else becomes its ``str``."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)
