"""What a process observes of runs: whether it traces or counts at all (``observing``), and
each run's end, once per run (``observe_end``: its span, orchestrator/telemetry.py, and its
count, orchestrator/metrics.py).
"""

from __future__ import annotations

from typing import Any

import orchestrator.metrics as metrics
from orchestrator.telemetry import END_MARK, ENDED, MARK_END, RUN_FIELDS, emit_run_span
from orchestrator.telemetry import enabled as tracing


def observing() -> bool:
    """Tracing or counting is on in this process: worth a Redis read or two per step."""
    return tracing() or metrics.counting()


def observe_end(store: Any, run_id: str, state: dict[str, str] | None = None) -> bool:
    """Count a run's end and emit its span, once per run, in whichever process sees it first
    (the worker that ended it, the tool worker that finds it aborted, the API that aborted it)."""
    if not observing():
        return False
    if state is None:
        raw = store.redis.hmget(store.keys.run(run_id), RUN_FIELDS)
        state = {k: v.decode() for k, v in zip(RUN_FIELDS, raw, strict=True) if v is not None}
    status = state.get("status")
    if status not in ENDED:
        return False
    if not store.redis.eval(MARK_END, 1, store.keys.run(run_id), END_MARK):
        return False
    m = metrics.get()
    if m is not None:
        m.runs_ended.labels(status, state.get("exit", "")).inc()
    emit_run_span(store.keys.prefix, run_id, state)
    return True
