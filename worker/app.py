"""The Celery app (``celery -A worker.app worker|flower``) and how steps are enqueued.

Importing this module is cheap: it neither imports the task modules (the
worker does, at start) nor litellm, so the producer client can use it to send.

Delivery settings, and why:
- JSON only: task payloads are plain data, never pickles.
- ``task_acks_late`` + ``task_reject_on_worker_lost``: a message is acked after
  its task ran, so one held by a dying worker is delivered again; duplicates are
  harmless because every step is fenced in Redis (see orchestrator/scripts.py).
- prefetch multiplier 1: a worker holds no more messages than it has slots.
- ``visibility_timeout`` far above any task's run time (tool_timeout_s is at most
  hours): redelivery by the transport is a last resort; the lease sweeper
  recovers lost steps within TOOLOOP_RECOVERY_S.
- results ignored: the run store holds the outcome; storing task results costs
  ~1 ms CPU per task for nothing.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

from celery import Celery
from kombu import Queue
from kombu.transport import redis as kombu_redis

from orchestrator.keys import Keys
from orchestrator.settings import Settings, get_settings
from orchestrator.store import RunStore

log = logging.getLogger(__name__)

TURN_TASK = "tooloop.turn"
TOOL_TASK = "tooloop.tool"
VISIBILITY_TIMEOUT_S = 6 * 3600


# kombu's Redis transport, after a Redis restart: restoring unacked messages when it
# closes the dead channel, or acking a message that finished meanwhile, dereferences
# the channel's lost connection (AttributeError: 'NoneType' object has no attribute
# 'hostname' / 'client'), which Celery treats as unrecoverable: the worker exits
# instead of reconnecting. Leaving such messages in kombu's unacked index is safe:
# the lease sweeper re-enqueues the steps they carried, and duplicates are no-ops.
def _tolerate_lost_channel(method: Any) -> Any:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except AttributeError:
            log.warning("broker channel lost: %s skipped, the lease sweeper covers it",
                        method.__name__)  # fmt: skip
            return None

    return call


kombu_redis.QoS.restore_unacked = _tolerate_lost_channel(kombu_redis.QoS.restore_unacked)
kombu_redis.QoS.ack = _tolerate_lost_channel(kombu_redis.QoS.ack)


# kombu's Redis transport builds a new redis.Redis client for every publish and every
# ack; with redis-py 8 building one costs ~0.2 ms of CPU (it registers ~170 response
# callbacks): a quarter of a busy turn process's CPU, measured with py-spy. A client
# over the channel's pool holds no connection of its own, so one per channel serves.
_kombu_create_client = kombu_redis.Channel._create_client


def _client_per_channel(self: Any, asynchronous: bool = False) -> Any:
    if asynchronous:
        return _kombu_create_client(self, asynchronous)
    client = self.__dict__.get("_tooloop_client")
    if client is None or client.connection_pool is not self.pool:  # pools are reset on reconnect
        client = self.__dict__["_tooloop_client"] = _kombu_create_client(self, False)
    return client


kombu_redis.Channel._create_client = _client_per_channel


def make_app(settings: Settings | None = None) -> Celery:
    settings = settings or get_settings()
    keys = Keys(settings.key_prefix)
    transport = {
        "global_keyprefix": keys.broker_prefix,
        "visibility_timeout": VISIBILITY_TIMEOUT_S,
    }
    app = Celery("tooloop", broker=settings.broker, backend=settings.redis_url)
    app.conf.update(
        include=["worker.maintenance", "worker.turn", "worker.tool_task", "worker.supervision"],
        imports=["worker.builtins", *settings.tool_modules],
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        task_store_errors_even_if_ignored=False,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options=transport,
        result_backend_transport_options=transport,
        broker_connection_retry_on_startup=True,
        # None would disable the pool: a new connection per publish (~8 ms each here).
        broker_pool_limit=256,
        task_default_queue=keys.turn_queue,
        # Both queues declared: a plain `celery -A worker.app worker` serves turns and tools.
        task_queues=[Queue(keys.turn_queue), Queue(keys.tool_queue)],
        task_routes={TURN_TASK: {"queue": keys.turn_queue}, TOOL_TASK: {"queue": keys.tool_queue}},
        worker_send_task_events=True,
        task_send_sent_event=True,
        worker_hijack_root_logger=False,
        worker_soft_shutdown_timeout=10.0,
        worker_enable_soft_shutdown_on_idle=True,
        # A task running when the broker connection drops is let finish: its redelivery
        # is a no-op (fenced in Redis), while cancelling would lose a tool call's work.
        worker_cancel_long_running_tasks_on_connection_loss=False,
        result_expires=3600,
    )
    app.tooloop_settings = settings  # type: ignore[attr-defined]
    return app


app = make_app()


@lru_cache(maxsize=1)
def get_store() -> RunStore:
    """This process's run store (redis-py reconnects by itself after a fork)."""
    return RunStore.from_settings(app.tooloop_settings)  # type: ignore[attr-defined]


# Queues come from ``task_routes``, so they follow the app's key prefix.
def enqueue_turn(run_id: str, iteration: int, celery_app: Celery | None = None) -> None:
    (celery_app or app).send_task(
        TURN_TASK,
        args=(run_id, iteration),
        task_id=f"turn-{run_id}-{iteration}",
        ignore_result=True,
    )


def enqueue_call(payload: dict[str, Any], celery_app: Celery | None = None) -> None:
    hard_limit = payload["timeout_s"] + 60  # the sandbox cuts first; this is a backstop
    (celery_app or app).send_task(
        TOOL_TASK,
        args=(payload,),
        task_id=f"tool-{payload['run_id']}-{payload['key']}",
        ignore_result=True,
        time_limit=hard_limit,
    )
