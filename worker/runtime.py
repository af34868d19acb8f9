"""This worker process's run store: one client and one connection pool for its tasks."""

from __future__ import annotations

from functools import lru_cache

from orchestrator.dispatch import default_app
from orchestrator.store import RunStore


@lru_cache(maxsize=1)
def get_store() -> RunStore:
    """This process's run store, from its Celery app's settings (redis-py reconnects by
    itself after a fork)."""
    return RunStore.from_settings(default_app().tooloop_settings)  # type: ignore[attr-defined]
