"""Leases and liveness, inside the workers (nothing extra to deploy).

- ``INFLIGHT``: the turns this process is executing (on its threads or waiting
  on its event loop); a heartbeat thread, started on first use in each process,
  extends their leases.
  (Tool calls heartbeat from their own wait loop, see ``tool_task``.)
- ``Maintenance``: one thread per worker that sweeps the lease index and
  re-enqueues the steps of runs whose worker was lost, aborts runs paused past
  ``pause_max_s``, and publishes the worker's tool catalog.

Recovery bound R (``TOOLOOP_RECOVERY_S``): a step whose worker dies is noticed once
its lease expires (R / 4 after the last heartbeat) by the next sweep (every R / 20), and
sent again ahead of the work queued meanwhile (on Redis): under a third of R from the
loss, the rest left for the queue, a worker's start and redoing the step
(``orchestrator/settings.py``, docs/guarantees.md).
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import redis
from celery import signals

from orchestrator import metrics
from orchestrator.keys import CATALOG_REFRESH_S, SHARDS
from orchestrator.models import Exit
from orchestrator.settings import get_settings
from orchestrator.store import Dispatch, Finish, Held, Recovery, RunStore
from worker import broker, fairshare

log = logging.getLogger(__name__)

T = TypeVar("T")
TRANSIENT = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError,
             redis.exceptions.ReadOnlyError, redis.exceptions.TryAgainError)  # fmt: skip


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
SEND_THREADS = 8  # publishers of a sweep's re-sends (each publish waits on the broker)


class Sweeper:
    """Finds lost steps, one shard at a time, and sends them again.

    Each shard is swept under its own lock (any worker may take any free shard), so
    sweeping scales with the workers. For a run past its next look, RECOVER (one
    script) ends it if its pause expired, gives up a step past its attempts, and says
    which steps to send again (their holder was lost) and which messages to look for
    (never taken: late, or lost?). A message still in its queue is late: it is left
    alone, so a backlog never grows a step's messages beyond one. Each run is handled
    on its own: one that cannot be read is logged and ended on error, never stopping
    the sweep.
    """

    def __init__(self, store: RunStore, name: str, celery_app: Any = None) -> None:
        self.store, self.name, self.celery = store, name, celery_app
        self._broker: redis.Redis | None = None
        self._tools_seen: dict[str, float] | None = None
        # task id -> when a sweep first found that call waiting in its tool's queue (Redis
        # time, s): a tool no worker ever published counts as missing from then, not forever
        self._waiting_since: dict[str, float] = {}
        self._outbox: list[Dispatch] = []  # steps to send again, published by _flush

    def sweep(self) -> int:
        """One round over every shard this worker can lock now; steps sent again.
        Messages never taken are looked for once per round (one pass over each queue,
        whatever the number of shards): RESEND is fenced by generation, so acting after
        the shard locks lapsed is safe."""
        self._tools_seen = None
        sent, checks = 0, []
        for shard in random.sample(range(SHARDS), SHARDS):
            shard_sent, shard_checks = self.sweep_shard(shard)
            sent, checks = sent + shard_sent, checks + shard_checks
        if checks:
            sent += self._check_queues(checks, self.store.time_ms())
        return sent

    def sweep_shard(self, shard: int) -> tuple[int, list[tuple[str, Dispatch]]]:
        """One shard: (steps sent again, messages to look for in their queues)."""
        due = self.store.due(shard, self.name)
        if due is None:
            return 0, []
        now, run_ids, expired = due
        if expired:
            self.store.drop_expired(shard, expired, now)
        checks: list[tuple[str, Dispatch]] = []
        for run_id, found in zip(run_ids, self.store.recover_many(run_ids), strict=True):
            if isinstance(found, Exception):
                self._unreadable(run_id, found)
                continue
            self._guard(run_id, self._act, found)
            checks += [(run_id, c) for c in found.checks]
        return self._flush(), checks

    def _act(self, found: Recovery) -> int:
        if found.outcome == "gated":  # held for fair share, never queued: queue it (worker/fairshare.py)
            fairshare.queue_gated(self.store, found.run_id, self.celery)
            return 0
        if found.outcome != "steps":
            if found.outcome in ("pause_expired", "gave_up"):
                log.warning("run %s ended by the sweeper: %s", found.run_id, found.outcome)
            return 0
        for dispatch in found.sends:
            log.warning("run %s: %s lost; sent again (generation %d)", found.run_id, dispatch.step,
                        dispatch.gen)  # fmt: skip
            self._outbox.append(dispatch)
        return len(found.sends)

    def _check_queues(self, checks: list[tuple[str, Dispatch]], now: int) -> int:
        """Messages never taken: those still queued are late (a call of a tool no live
        worker has published for a while is recorded failed); the others are lost."""
        from worker.app import call_queue, call_task_id, turn_task_id

        by_queue: dict[str, dict[str, Dispatch]] = defaultdict(dict)
        for _, d in checks:
            if d.payload is None:
                by_queue[self.store.keys.turn_queue][turn_task_id(d.run_id, d.iteration, d.gen)] = d
            else:
                by_queue[call_queue(self.store.keys, d.payload)][call_task_id(d.payload, d.gen)] = d
        waiting: set[str] = set()
        for queue, wanted in by_queue.items():
            present = self._queued(queue, list(wanted))
            for task_id, d in wanted.items():
                if task_id in present:
                    waiting.add(task_id)
                    self._guard(d.run_id, self._maybe_unroutable, d, now, task_id)
                else:
                    self._guard(d.run_id, self._resend, d)
        self._waiting_since = {k: v for k, v in self._waiting_since.items() if k in waiting}
        return self._flush()

    def _resend(self, dispatch: Dispatch) -> int:
        again = self.store.resend(dispatch)
        if again is None:
            return 0
        log.warning("run %s: %s message lost; sent again (generation %d)", dispatch.run_id,
                    dispatch.step, again.gen)  # fmt: skip
        self._outbox.append(again)
        return 1

    def _maybe_unroutable(self, dispatch: Dispatch, now: int, task_id: str) -> int:
        """A queued call of a tool that no live worker has published for unroutable_s (for a
        tool no worker ever published, counted from when this sweeper first found the call
        waiting: a tools worker that starts after the call was made is not too late)."""
        from worker.app import call_queue

        payload = dispatch.payload
        if payload is None or call_queue(self.store.keys, payload) == self.store.keys.tool_queue:
            return 0
        if self._tools_seen is None:
            self._tools_seen = self.store.tools_last_seen()
        last_seen = self._tools_seen.get(payload["tool"])
        if not last_seen:
            last_seen = self._waiting_since.setdefault(task_id, now / 1000)
        if now / 1000 - last_seen < self.store.settings.unroutable_s:
            return 0
        from worker.tool_task import unroutable

        unroutable(self.store, payload, dispatch.gen, self.celery)
        return 0

    def _queued(self, queue: str, task_ids: list[str]) -> set[str]:
        """Task ids found waiting in ``queue``. kombu's Redis transport keeps a queue as a
        list (``LPUSH`` to publish, ``BRPOP`` to consume), read a slice per script, newest
        first, never in one pass that would hold Redis (``RunStore.queued``). RabbitMQ
        cannot be searched by id, and drops a message past its delivery
        limit: a message past its deadline is late while its queue holds a backlog it may
        wait behind, and gone once nothing waits there (a resend is fenced by generation,
        and with no backlog it cannot pile up)."""
        broker = self._broker_client()
        if broker is not None:
            return self.store.queued(broker, self.store.keys.broker_prefix + queue, task_ids)
        return set(task_ids) if self._waiting(queue) else set()

    def _waiting(self, queue: str) -> bool:
        from worker.app import app

        return bool(broker.queue_depths(self.celery or app, [queue])[queue])

    def _broker_client(self) -> redis.Redis | None:
        url = self.store.settings.broker
        if url == self.store.settings.redis_url:  # the store's Redis, whatever its URL form (sentinel)
            return self.store.redis
        if not url.startswith(("redis://", "rediss://", "unix://")):
            return None
        if self._broker is None:
            self._broker = redis.Redis.from_url(url, socket_timeout=30)
        return self._broker

    def _flush(self) -> int:
        """Publish the steps to send again. Each publish is a broker round trip or two (the
        task-sent event): a whole fleet's worth (thousands, after a mass loss) goes out from
        several threads. A send that fails is healed by a later sweep: the step's message
        is then missing from its queue, and RESEND sends it."""
        out, self._outbox = self._outbox, []
        if len(out) <= SEND_THREADS:
            for dispatch in out:
                self._send_logged(dispatch)
        else:
            with ThreadPoolExecutor(SEND_THREADS, thread_name_prefix="tooloop-resend") as pool:
                list(pool.map(self._send_logged, out))
        return len(out)

    def _send_logged(self, dispatch: Dispatch) -> None:
        try:
            self._send(dispatch)
        except Exception:
            log.warning("run %s: sending %s again failed; a later sweep retries", dispatch.run_id,
                        dispatch.step, exc_info=True)  # fmt: skip

    def _send(self, dispatch: Dispatch) -> None:
        from worker.app import send

        metrics.count_recovery(dispatch.payload is None, int(dispatch.payload is not None))
        send(dispatch, self.celery)
        self._ahead(dispatch)

    def _ahead(self, dispatch: Dispatch) -> None:
        """On a Redis broker, the message just sent goes to the end of its queue taken next:
        its run has stood still a lease already, and must not wait again behind the work
        queued meanwhile (RabbitMQ's quorum queues keep their order: there it waits its turn)."""
        from worker.app import call_queue, call_task_id, turn_task_id

        broker = self._broker_client()
        if broker is None:
            return
        keys = self.store.keys
        if dispatch.payload is None:
            queue, task_id = keys.turn_queue, turn_task_id(dispatch.run_id, dispatch.iteration, dispatch.gen)
        else:
            queue, task_id = call_queue(keys, dispatch.payload), call_task_id(dispatch.payload, dispatch.gen)
        self.store.jump(broker, keys.broker_prefix + queue, task_id)

    def _unreadable(self, run_id: str, exc: Exception) -> None:
        """A run the sweeper cannot read (corrupt state): ended on error, logged."""
        log.error("run %s cannot be read by the sweeper: %s; ending it", run_id, exc)
        end = Finish(Exit.error, error=f"run state unreadable: {type(exc).__name__}: {exc}"[:500],
                     error_type="StateUnreadable")  # fmt: skip
        try:
            self.store.finish(run_id, end)
        except Exception:
            log.exception("run %s: could not end it either", run_id)

    def _guard(self, run_id: str, fn: Callable[..., int], *args: Any) -> int:
        """One run's recovery, isolated: a failure is logged (and the run ended if it
        cannot be read), never stopping the sweep of the others."""
        try:
            return fn(*args)
        except TRANSIENT:
            raise  # Redis is away: the whole round stops, the next one retries
        except Exception as exc:
            self._unreadable(run_id, exc)
            return 0


def reenqueue(store: RunStore, recovery: Recovery, celery_app: Any = None) -> int:
    """Act on one run's recovery (the sweeper's path, for one run): steps sent again."""
    sweeper = Sweeper(store, "reenqueue", celery_app)
    sweeper._act(recovery)
    return sweeper._check_queues([(recovery.run_id, c) for c in recovery.checks], store.time_ms())


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
        instance.app.amqp.queues.select_add(broker.tool_queue(keys, instance.app.conf.broker_url or "",
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
    over meanwhile; it is billed once either way)."""
    timer = threading.Timer(HAND_BACK_AFTER_S, INFLIGHT.hand_back)
    timer.daemon = True
    timer.start()


@signals.worker_shutdown.connect
def _shutdown(**_: Any) -> None:
    for thread in _maintenance:
        thread.stop()
