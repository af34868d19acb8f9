"""Leases and liveness, inside the workers (nothing extra to deploy).

- ``INFLIGHT``: the turns this process is executing (on its threads or waiting
  on its event loop); a heartbeat thread, started on first use in each process,
  extends their leases.
  (Tool calls heartbeat from their own wait loop, see ``tool_task``.)
- ``Maintenance``: one thread per worker that sweeps the lease index and
  re-enqueues the steps of runs whose worker was lost (``orchestrator/recovery.py``), aborts runs paused past
  ``pause_max_s``, and publishes the worker's tool catalog.

Recovery bound R (``TOOLOOP_RECOVERY_S``): a step whose worker dies is noticed once
its lease expires (R / 6 after the last heartbeat) by the next sweep (every R / 20), and
sent again ahead of the work queued meanwhile (on Redis): under a third of R from the
loss, the rest left for the queue, a worker's start and redoing the step
(``orchestrator/settings.py``, docs/guarantees.md).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from celery import signals

from orchestrator.broker import tool_queue
from orchestrator.keys import CATALOG_REFRESH_S
from orchestrator.recovery import TRANSIENT, Sweeper
from orchestrator.settings import get_settings
from orchestrator.store import Held, RunStore
from worker import fairshare

log = logging.getLogger(__name__)

T = TypeVar("T")


def with_retries(fn: Callable[..., T], *args: Any, budget_s: float) -> T:
    """Call ``fn``, retrying a Redis blip (a restart, a failover) with backoff for up to
    ``budget_s`` (the caller's lease): a finished result is not lost to a blip. Retrying
    is safe: every script is fenced, and a reply or record is counted once."""
    deadline = time.monotonic() + budget_s
    pause = 0.05
    while True:
        try:
            return fn(*args)
        except TRANSIENT:
            if time.monotonic() + pause >= deadline:
                raise
            log.warning("Redis unavailable during %s; retrying in %.2fs", fn.__name__, pause)
            time.sleep(pause)
            pause = min(pause * 2, 1.0)


class InFlight:
    """Turns held by this process, heartbeated by one thread per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[Held, float] = {}  # -> monotonic time after which it is not beaten
        self._pid = 0
        self.store: RunStore | None = None
        self.handed_back = False  # shutting down: leases no longer extended

    @contextmanager
    def hold(self, store: RunStore, held: Held, max_s: float | None = None) -> Iterator[None]:
        """Heartbeat ``held`` while the block runs, for at most ``max_s``: a step stuck
        longer (a model call that never returns) lets its lease lapse and is re-sent."""
        self.add(store, held, max_s)
        try:
            yield
        finally:
            self.release(held)

    def add(self, store: RunStore, held: Held, max_s: float | None = None) -> None:
        """Start heartbeating ``held`` (for at most ``max_s``) until ``release``: for work that
        outlives the task that started it (a turn waiting on the event loop)."""
        with self._lock:
            self._ensure_heartbeat(store)
            self._items[held] = time.monotonic() + (max_s if max_s is not None else float("inf"))

    def extend(self, held: Held, max_s: float) -> bool:
        """Beat ``held`` for ``max_s`` from now (its next bounded piece of work: a model call,
        the record). False if it is beaten no longer (taken over, ended, past its time, or
        released): it must not start more work."""
        with self._lock:
            until, now = self._items.get(held), time.monotonic()
            if until is None or until < now:
                return False
            self._items[held] = now + max_s
            return True

    def release(self, held: Held) -> None:
        with self._lock:
            self._items.pop(held, None)

    def items(self) -> list[Held]:
        with self._lock:
            return list(self._items)

    def _due(self) -> list[Held]:
        """Held steps still within their time; the others are dropped (once, logged)."""
        now = time.monotonic()
        with self._lock:
            over = [h for h, until in self._items.items() if now > until]
            for h in over:
                self._items[h] = float("-inf")
            return [h for h, until in self._items.items() if until >= now]

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
            items = self._due()
            try:
                verdicts = self.store.heartbeat(items)
            except Exception:
                log.warning("heartbeat failed; retrying", exc_info=True)
                continue
            self._drop_lost(items, verdicts)

    def _drop_lost(self, items: list[Held], verdicts: list[int]) -> None:
        """Stop beating steps taken over or ended: the holder's writes are fenced anyway."""
        with self._lock:
            for held, verdict in zip(items, verdicts, strict=True):
                if verdict != 1 and held in self._items:
                    log.warning("%s %s/%d is no longer ours (%s)", held.kind, held.run_id,
                                held.iteration, "ended" if verdict < 0 else "taken over")  # fmt: skip
                    self._items[held] = float("-inf")

    def hand_back(self) -> None:
        """Stop extending leases and let them lapse, so other workers take the steps over."""
        self.handed_back = True
        items = self.items()
        if self.store is not None and items:
            log.warning("shutting down: handing back %d unfinished step(s)", len(items))
            self.store.hand_back(items)


INFLIGHT = InFlight()
HAND_BACK_AFTER_S = 10.0  # a warm shutdown lets running turns finish this long first


class Maintenance(threading.Thread):
    def __init__(self, store: RunStore, name: str, info: dict[str, Any], celery_app: Any = None) -> None:
        super().__init__(name="tooloop-maintenance", daemon=True)
        self.store, self.worker_name, self.info = store, name, info
        self.sweeper = Sweeper(store, name, celery_app)
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
        return self.sweeper.sweep() + fairshare.sweep(self.store, self.worker_name)

    def stop(self) -> None:
        self.stopping.set()
        self._guarded(self.store.remove_worker, self.worker_name)

    @staticmethod
    def _guarded(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # Redis away: keep going, the next round retries
            log.warning("maintenance step %s failed", fn.__name__, exc_info=True)


def worker_info(queues: list[str], tools: list[dict[str, Any]],
                mcp_unavailable: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """What the registry shows of this worker; ``mcp_unavailable``: MCP servers whose tools
    are not in its catalog, with why (``tooloop doctor``, ``tooloop tools``)."""
    from worker.sandbox import layer_reasons, layers  # probes bubblewrap once, before the pool forks

    return {"queues": queues, "tools": tools, "host": socket.gethostname(), "pid": os.getpid(),
            "sandbox": layers(), "sandbox_off": layer_reasons(),
            "mcp_unavailable": mcp_unavailable or {},
            "secret_key": bool(get_settings().secret_key)}  # fmt: skip  (whether, never which)


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

    unavailable: dict[str, str] = {}
    if keys.tool_queue in queues:
        from worker.sources.mcp_tools import start_or_exit

        unavailable = start_or_exit(get_store().settings.mcp_servers)  # their tools join the registry
    tools = catalog() if keys.tool_queue in queues else []
    for tool in tools:  # each tool's own queue: a call goes only to workers that have its tool
        instance.app.amqp.queues.select_add(tool_queue(keys, instance.app.conf.broker_url or "",
                                                              tool["name"]))  # fmt: skip
    _maintenance.append(Maintenance(get_store(), sender, worker_info(queues, tools, unavailable)))


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    for thread in _maintenance:
        thread.start()


@signals.worker_shutting_down.connect
def _shutting_down(**_: Any) -> None:
    """Warm shutdown: turns still running after HAND_BACK_AFTER_S are handed back (a
    reply that comes before the process exits is recorded only if nobody took the turn
    over meanwhile; it is billed once either way). A leaving worker sweeps no more: the
    steps it would send again (its own, handed back) are the other workers' to send. Over
    RabbitMQ its consumer may still be registered while it drains, so its own re-send
    could be delivered back to it and wait there until its connection closed."""
    for thread in _maintenance:
        thread.stop()
    timer = threading.Timer(HAND_BACK_AFTER_S, INFLIGHT.hand_back)
    timer.daemon = True
    timer.start()


@signals.worker_shutdown.connect
def _shutdown(**_: Any) -> None:
    for thread in _maintenance:
        thread.stop()
