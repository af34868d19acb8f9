"""Finding lost steps and sending them again: the lease sweeper.

Every worker runs it (``worker/maintenance.py``: a thread per worker, each sweep
interval); a producer that resumes a paused run acts on that run's recovery the
same way (``reenqueue``). What a step's lease is, and the recovery bound R
(``TOOLOOP_RECOVERY_S``): ``worker/maintenance.py``, ``orchestrator/settings.py``.
"""

from __future__ import annotations

import json
import logging
import random
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis

import orchestrator.metrics as metrics
from orchestrator.broker import queue_depths, redis_of
from orchestrator.calls import model_call_id
from orchestrator.dispatch import call_queue, default_app, enqueue_turn, message_of, send
from orchestrator.fairshare import queue_gated
from orchestrator.keys import SHARDS
from orchestrator.models import Exit, ToolCallRecord
from orchestrator.store import Dispatch, Finish, Recovery, RunStore

log = logging.getLogger(__name__)
_UNSET = object()  # the broker's client not yet looked up (None: RabbitMQ)

TRANSIENT = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError,
             redis.exceptions.ReadOnlyError, redis.exceptions.TryAgainError)  # fmt: skip
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
        self._broker: Any = _UNSET
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
        if found.outcome == "gated":  # held for fair share, never queued: queue it (fairshare.py)
            queue_gated(self.store, found.run_id, self.celery)
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
        by_queue: dict[str, dict[str, Dispatch]] = defaultdict(dict)
        for _, d in checks:
            queue, task_id = message_of(self.store.keys, d)
            by_queue[queue][task_id] = d
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
        return bool(queue_depths(self.celery or default_app(), [queue])[queue])

    def _broker_client(self) -> redis.Redis | None:
        if self._broker is _UNSET:
            self._broker = redis_of(self.store)
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
        metrics.count_recovery(dispatch.payload is None, int(dispatch.payload is not None))
        send(dispatch, self.celery)
        self._ahead(dispatch)

    def _ahead(self, dispatch: Dispatch) -> None:
        """On a Redis broker, the message just sent goes to the end of its queue taken next:
        its run has stood still a lease already, and must not wait again behind the work
        queued meanwhile (RabbitMQ's quorum queues keep their order: there it waits its turn)."""
        broker = self._broker_client()
        if broker is None:
            return
        queue, task_id = message_of(self.store.keys, dispatch)
        self.store.jump(broker, self.store.keys.broker_prefix + queue, task_id)

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


def unroutable(store: RunStore, payload: dict[str, Any], gen: int, celery_app: Any = None) -> None:
    """The sweeper's verdict on a queued call of a tool no live worker has published for
    ``unroutable_s``: recorded failed for nobody, if its message is still the current one."""
    error = (f"UnknownTool: no live worker has had tool {payload['tool']!r} for "
             f"{store.settings.unroutable_s:g}s")  # fmt: skip
    record = ToolCallRecord(call_id=payload["call_id"], tool_name=payload["tool"],
                            inputs=_parse(payload.get("arguments")), success=False, error=error,
                            iteration=payload["iteration"])  # fmt: skip
    message = {"role": "tool", "tool_call_id": model_call_id(payload), "content": f"Error: {error}"}
    verdict, next_gen = store.record_call(payload["run_id"], payload["iteration"], payload["index"],
                                          "", record, json.dumps(message), gen=gen)  # fmt: skip
    log.warning("call %s/%s: %s (%s)", payload["run_id"], payload["key"], error, verdict)
    if verdict == "next":
        enqueue_turn(payload["run_id"], payload["iteration"] + 1, next_gen, celery_app)


def _parse(arguments: Any) -> Any:
    try:
        return json.loads(arguments or "{}")
    except (TypeError, json.JSONDecodeError):
        return arguments
