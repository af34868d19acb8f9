"""Tenant fair share, the workers' side: the sweep that keeps the slots true.

The fast paths tell the queue at once (orchestrator/fairshare.py): a submit, a run's end
in a worker (``children.hand_off``), a pause, an abort, a resume. What they miss is found
here, each sweep interval, by one worker at a time (a lock in Redis):

- a run holding a slot that ended (by the sweeper, an expired pause, its parent's abort)
  or was lost with its process before it told: its slot is given back;
- a run holding a slot that parked (paused, or every call of its turn waits for a person
  or a child run) gives it up; a parked run working again takes it back;
- a run admitted whose gate was not opened (its admitter died): opened, its turn sent;
- then waiting runs are admitted into whatever is free.

A run written gated but never queued (its submitter died in between) is found by the
lease sweeper: RECOVER answers 'gated', and ``orchestrator.fairshare.queue_gated`` queues it now.
"""

from __future__ import annotations

import logging
from typing import Any

from orchestrator import fairshare
from orchestrator.store import RunStore

log = logging.getLogger(__name__)

FIELDS = ("status", "phase", "pending", "approvals_pending", "children_waiting", "gate")
ENDED = ("completed", "failed", "aborted")


def parked(state: dict[str, str]) -> bool:
    """Paused, or in its tools phase with every call not done waiting for a person's
    decision or a child run: it holds no worker and gives its slot up."""
    if state["status"] == "paused":
        return True
    pending = int(state["pending"] or 0)
    waiting = int(state["approvals_pending"] or 0) + int(state["children_waiting"] or 0)
    return state["phase"] == "tools" and pending > 0 and waiting >= pending


def sweep(store: RunStore, holder: str, celery_app: Any = None) -> int:
    """One look at every run holding or parked with a slot (under the fair-share lock);
    turns sent."""
    fair = fairshare.of(store)
    if fair is None or not fair.policy.gating:
        return 0
    lock_ms = max(100, int(store.settings.sweep_interval_s * 1000 * 0.8))
    if not store.redis.set(store.keys.fair_lock(), holder, nx=True, px=lock_ms):
        return 0
    held = [(_s(r), _s(v)[0], _s(v)[2:]) for r, v in store.redis.hgetall(store.keys.fair_runs()).items()]
    held = [h for h in held if h[1] in "ap"]
    pipe = store.redis.pipeline(transaction=False)
    for run_id, _, _ in held:
        pipe.hmget(store.keys.run(run_id), FIELDS)
    admitted, closed = [], []
    for (run_id, slot, tenant), values in zip(held, pipe.execute() if held else [], strict=True):
        state = dict(zip(FIELDS, map(_s, values), strict=True))
        how = _how(slot, state)
        if how:
            log.info("run %s: fair share: %s (found by the sweep)", run_id, how)
            admitted += fair.move(run_id, how, tenant)
        elif slot == "a" and state["gate"]:
            closed.append(run_id)
    admitted += fair.pump()
    return fair.open(closed + admitted, celery_app)


def _s(value: Any) -> str:
    return "" if value is None else value.decode() if isinstance(value, bytes) else str(value)


def _how(slot: str, state: dict[str, str]) -> str:
    """What the run did that its slot does not show yet ('' nothing)."""
    if not state["status"] or state["status"] in ENDED:
        return "end"
    if slot == "a" and parked(state):
        return "park"
    if slot == "p" and not parked(state):
        return "resume"
    return ""
