"""Pause and abort, with what follows them: a paused run's running child runs pause
with it (and theirs), and a run paused or aborted gives its tenant's fair-share slot up
(orchestrator/fairshare.py). The directive itself is the store's (one script each);
resume, which also sends what the run was parked on, is ``Client.resume``."""

from __future__ import annotations

from orchestrator.children import children_of
from orchestrator.fairshare import moved
from orchestrator.store import RunStore


def pause(store: RunStore, run_id: str, by: str = "operator") -> str:
    """'ok', 'already', or why not ('missing', 'ended', ...)."""
    verdict = store.pause(run_id, by)
    if verdict in ("ok", "already"):  # its child runs pause with it (orchestrator/children.py)
        for child in children_of(store, run_id):
            status = store.status(child)
            if status is not None and not status.ended and status.value != "paused":
                pause(store, child, by=f"{by} (parent {run_id})")
    if verdict == "ok":  # a paused run gives its tenant's slot up
        moved(store, run_id, "park")
    return verdict


def abort(store: RunStore, run_id: str, by: str = "operator", reason: str = "abort requested") -> str:
    """'ok', or why not; ``TooLong`` (nothing written) when ``reason`` is over REASON_MAX_CHARS."""
    verdict = store.abort(run_id, by, reason)
    if verdict == "ok":  # its slot goes to the next waiting run
        moved(store, run_id, "end")
    return verdict
