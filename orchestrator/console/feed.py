"""The one place the console reads a run's progress events.

The store hands them as the typed models of ``orchestrator.events`` (numbers as numbers,
booleans as booleans, ``ts`` as a datetime); the timeline reads them as plain dicts of
those typed values (``model_dump``), so an event of a type this console does not know
(a newer worker's) still shows, with its fields as they came.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.store import RunStore


def read(store: RunStore, run_id: str) -> list[dict[str, Any]]:
    """Every event the run's capped stream still keeps, oldest first."""
    events = store.read_events(run_id, "0", count=store.settings.events_maxlen * 2)
    return [event.model_dump() for event in events]
