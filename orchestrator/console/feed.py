"""The one place the console reads a run's progress events.

Events are metadata only (orchestrator/scripts.py writes them). The console reads them
as plain dicts with typed values (numbers as numbers, booleans as booleans), so the
typed event models of ``orchestrator.events`` can take over here without touching the
rest of the console: ``typed`` is the only function that knows the stream's raw shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.store import RunStore

INT_FIELDS = frozenset({"ts", "iteration", "tool_calls", "tokens_used", "tokens", "count", "deadline",
                        "wait_ms", "before", "after", "lost_since"})  # fmt: skip
BOOL_FIELDS = frozenset({"success", "corrected"})
FLOAT_FIELDS = frozenset({"cost_usd"})


def typed(event_id: str, fields: dict[str, str]) -> dict[str, Any]:
    """One stream entry as a dict of typed values, with its ``id``."""
    out: dict[str, Any] = {"id": event_id}
    for name, raw in fields.items():
        out[name] = _value(name, raw)
    return out


def _value(name: str, raw: str) -> Any:
    try:
        if name in INT_FIELDS:
            return int(raw)
        if name in FLOAT_FIELDS:
            return float(raw)
    except ValueError:
        return raw
    if name in BOOL_FIELDS:
        return raw in ("1", "true", "True")
    return raw


def read(store: RunStore, run_id: str) -> list[dict[str, Any]]:
    """Every event the run's capped stream still keeps, oldest first."""
    entries = store.read_events(run_id, "0", count=store.settings.events_maxlen * 2)
    return [typed(event_id, fields) for event_id, fields in entries]
