"""Tasks that end on the event loop: the thread is freed at once, the message acked at the end.

A turn spends nearly all its time waiting on the model. Its task claims the turn,
prepares the request, hands the rest to the process's event loop (``worker/aio.py``)
and returns: the pool thread serves the next message while the model call is a
socket and a coroutine. Durability is unchanged:

- the message is acked (``task_acks_late``) only when the deferred work is done: the
  task's Request class (``DeferredAck``) holds the ack until then. Celery calls
  ``acknowledge`` in the thread that ran the task, right after it returned, so a
  thread-local hands the future over;
- unacked messages count against the channel's prefetch, so a process holds at most
  its prefetch count (threads x prefetch multiplier, see ``worker/launcher.py``) of
  deferred tasks: a full process stops taking messages, other processes take them;
- the turn's lease is heartbeated while the work is in flight (``INFLIGHT``), and a
  process that dies leaves the message unacked and the lease to expire, as before.

At warm shutdown, work still in flight gets until ``DRAIN_S`` after the shutdown began
to finish (``drain``); what is left is handed back with the leases.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any

from celery import signals
from celery.worker.request import Request

log = logging.getLogger(__name__)

DRAIN_S = 12.0  # past the hand-back (10 s after shutdown began): the leases are already out
_local = threading.local()
_lock = threading.Lock()
_pending: set[concurrent.futures.Future] = set()
_shutdown_began: list[float] = []


def defer(future: concurrent.futures.Future) -> None:
    """Called by a task as its last step: its message is acked once ``future`` is done."""
    with _lock:
        _pending.add(future)
    future.add_done_callback(_forget)
    _local.future = future


def reset() -> None:
    """Called by a task as its first step: nothing deferred yet in this thread."""
    _local.future = None


def deferred() -> concurrent.futures.Future | None:
    """The future the task running in this thread deferred to, if any (telemetry uses it)."""
    return getattr(_local, "future", None)


def in_flight() -> int:
    with _lock:
        return len(_pending)


def _forget(future: concurrent.futures.Future) -> None:
    with _lock:
        _pending.discard(future)


class DeferredAck(Request):
    """A Request whose ack waits for the work its task deferred to the event loop."""

    def acknowledge(self) -> None:
        future = deferred()
        _local.future = None
        if future is None or future.done():
            super().acknowledge()
            return
        future.add_done_callback(lambda _: self._ack_now())

    def _ack_now(self) -> None:
        try:
            super().acknowledge()
        except Exception:  # the channel went away (shutdown, lost broker): the lease covers the step
            log.debug("late ack of %s failed", self.id, exc_info=True)


def drain(until: float) -> int:
    """Wait (until the monotonic time ``until``) for deferred work; returns how many remain."""
    while True:
        with _lock:
            left = list(_pending)
        if not left or time.monotonic() >= until:
            return len(left)
        concurrent.futures.wait(left, timeout=max(0.0, until - time.monotonic()))


@signals.worker_shutting_down.connect
def _shutting_down(**_: Any) -> None:
    _shutdown_began.append(time.monotonic())


@signals.worker_shutdown.connect
def _drain_at_shutdown(**_: Any) -> None:
    began = _shutdown_began[0] if _shutdown_began else time.monotonic()
    left = drain(began + DRAIN_S)
    if left:
        log.warning("shutting down with %d deferred turn(s) unfinished: their leases are handed back", left)
