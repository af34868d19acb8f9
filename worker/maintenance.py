"""Leases and liveness, inside the workers (nothing extra to deploy).

- ``INFLIGHT``: the turns this process is executing; a heartbeat thread,
  started on first use in each process, extends their leases.
  (Tool calls heartbeat from their own wait loop, see ``tool_task``.)
- ``Maintenance``: one thread per worker that sweeps the lease index and
  re-enqueues the steps of runs whose worker was lost, aborts runs paused past
  ``pause_max_s``, and publishes the worker's tool catalog.

Recovery bound: a step whose worker dies is noticed once its lease expires
(``TOOLOOP_RECOVERY_S / 2`` after the last heartbeat) by the next sweep (every
``TOOLOOP_RECOVERY_S / 12``), then re-enqueued: well under TOOLOOP_RECOVERY_S.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import signals

from orchestrator.keys import CATALOG_REFRESH_S
from orchestrator.store import Recovery, RunStore

log = logging.getLogger(__name__)


class InFlight:
    """Steps held by this process: (run_id, kind, key) -> count."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: Counter[tuple[str, str, str]] = Counter()
        self._pid = 0
        self.store: RunStore | None = None
        self.handed_back = False  # shutting down: leases no longer extended

    @contextmanager
    def hold(self, store: RunStore, run_id: str, kind: str, key: str = "") -> Iterator[None]:
        item = (run_id, kind, key)
        with self._lock:
            self._ensure_heartbeat(store)
            self._items[item] += 1
        try:
            yield
        finally:
            with self._lock:
                self._items[item] -= 1
                if self._items[item] <= 0:
                    del self._items[item]

    def items(self) -> list[tuple[str, str, str]]:
        with self._lock:
            return list(self._items)

    def _ensure_heartbeat(self, store: RunStore) -> None:
        if self._pid == os.getpid():
            return
        self._pid, self.store = os.getpid(), store
        threading.Thread(target=self._beat, name="tooloop-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        assert self.store is not None
        while not self.handed_back:
            time.sleep(self.store.settings.heartbeat_s)
            if self.handed_back:
                return
            try:
                self.store.heartbeat(self.items())
            except Exception:
                log.warning("heartbeat failed; retrying", exc_info=True)


    def hand_back(self) -> None:
        """Stop extending leases and expire them, so other workers take the steps over."""
        self.handed_back = True
        if self.store is not None and self.items():
            log.warning("shutting down: handing back %d unfinished step(s)", len(self.items()))
            self.store.hand_back(self.items())


INFLIGHT = InFlight()
HAND_BACK_AFTER_S = 10.0  # a warm shutdown lets running turns finish this long first


def reenqueue(store: RunStore, recovery: Recovery) -> None:
    """Send again what a lost worker was doing for one run."""
    from worker.app import enqueue_call, enqueue_turn

    if recovery.pause_expired:
        spec = store.spec(recovery.run_id)
        limit = spec.pause_max_s if spec else "?"
        store.abort(recovery.run_id, by="tooloop", reason=f"paused longer than pause_max_s ({limit}s)")
        return
    if recovery.turn is not None:
        log.warning("run %s: turn %d lost; re-enqueued", recovery.run_id, recovery.turn)
        enqueue_turn(recovery.run_id, recovery.turn)
    for payload in recovery.calls or []:
        log.warning("run %s: tool call %s lost; re-enqueued", recovery.run_id, payload["key"])
        enqueue_call(payload)


class Maintenance(threading.Thread):
    def __init__(self, store: RunStore, name: str, info: dict[str, Any]) -> None:
        super().__init__(name="tooloop-maintenance", daemon=True)
        self.store, self.worker_name, self.info = store, name, info
        self.stopping = threading.Event()

    def run(self) -> None:
        interval = self.store.settings.sweep_interval_s
        beats = max(1, int(CATALOG_REFRESH_S / interval))
        for tick in range(1 << 62):
            if tick % beats == 0:
                self._guarded(self.store.publish_worker, self.worker_name, self.info)
            self._guarded(self.sweep)
            if self.stopping.wait(interval):
                return

    def sweep(self) -> int:
        count = 0
        for run_id in self.store.due_runs():
            recovery = self.store.recover(run_id)
            if recovery is not None:
                reenqueue(self.store, recovery)
                count += 1
        return count

    def stop(self) -> None:
        self.stopping.set()
        self._guarded(self.store.remove_worker, self.worker_name)

    @staticmethod
    def _guarded(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # Redis away: keep going, the next round retries
            log.warning("maintenance step %s failed", fn.__name__, exc_info=True)


def worker_info(queues: list[str], tools: list[dict[str, Any]]) -> dict[str, Any]:
    from worker.sandbox import layers  # probes bubblewrap once, before the pool forks

    return {"queues": queues, "tools": tools, "host": socket.gethostname(), "pid": os.getpid(),
            "sandbox": layers()}  # fmt: skip


# -- wiring into the Celery worker -----------------------------------------------
_maintenance: list[Maintenance] = []


@signals.celeryd_after_setup.connect
def _after_setup(sender: str, instance: Any, **_: Any) -> None:
    """Preload litellm on workers that serve turns, before they consume anything."""
    from worker.app import get_store

    queues = list(instance.app.amqp.queues.consume_from or instance.app.amqp.queues)
    keys = get_store().keys
    if keys.turn_queue in queues:
        from worker import llm

        llm.preload()
    from worker.registry import catalog

    tools = catalog() if keys.tool_queue in queues else []
    _maintenance.append(Maintenance(get_store(), sender, worker_info(queues, tools)))


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    for thread in _maintenance:
        thread.start()


@signals.worker_shutting_down.connect
def _shutting_down(**_: Any) -> None:
    """Warm shutdown: turns still running after HAND_BACK_AFTER_S are handed back (their
    reply, if it comes before the process exits, is still recorded unless the retry's
    came first: a reply is recorded and billed once either way)."""
    timer = threading.Timer(HAND_BACK_AFTER_S, INFLIGHT.hand_back)
    timer.daemon = True
    timer.start()


@signals.worker_shutdown.connect
def _shutdown(**_: Any) -> None:
    for thread in _maintenance:
        thread.stop()
