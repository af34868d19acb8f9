"""The Celery app (``celery -A worker.app worker|flower``) and how steps are enqueued.

Importing this module is cheap: it neither imports the task modules (the
worker does, at start) nor litellm, so the producer client can use it to send.

Delivery settings, and why:
- JSON only: task payloads are plain data, never pickles.
- ``task_acks_late`` + ``task_reject_on_worker_lost``: a message is acked after
  its task ran, so one held by a dying worker is delivered again; duplicates are
  harmless because every step is fenced in Redis (see orchestrator/scripts.py).
- prefetch multiplier 1: a worker holds no more messages than it has slots.
- Redis broker: ``visibility_timeout`` far above any task's run time
  (tool_timeout_s is at most hours): redelivery by the transport is a last
  resort; the lease sweeper recovers lost steps within TOOLOOP_RECOVERY_S.
- RabbitMQ broker: quorum queues, a delivery limit, a consumer timeout of the
  same length, publisher confirms (see ``worker/broker.py``); a message held by
  a lost consumer comes back at once, and the sweeper still covers the rest.
- results ignored: the run store holds the outcome; storing task results costs
  ~1 ms CPU per task for nothing.
- task events off unless TOOLOOP_TASK_EVENTS=1 or a monitor enables them (Flower does).
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

from celery import Celery, signals
from kombu.transport import redis as kombu_redis

from orchestrator.bounds import cut_text
from orchestrator.connections import celery_urls
from orchestrator.keys import Keys
from orchestrator.scrub import install_log_filter, scrub_text
from orchestrator.settings import Settings, get_settings
from orchestrator.store import RunStore
from worker import broker

log = logging.getLogger(__name__)

TURN_TASK = "tooloop.turn"
TOOL_TASK = "tooloop.tool"
VISIBILITY_TIMEOUT_S = broker.DELIVERY_TIMEOUT_S


def _patch_redis_transport() -> None:
    """Workarounds for kombu's Redis transport (not for AMQP: applied when the broker is Redis)."""
    if getattr(kombu_redis.Channel, "_tooloop_patched", False):
        return
    kombu_redis.QoS.restore_unacked = _tolerate_lost_channel(kombu_redis.QoS.restore_unacked)
    kombu_redis.QoS.ack = _tolerate_lost_channel(kombu_redis.QoS.ack)
    kombu_redis.Channel._create_client = _client_per_channel
    kombu_redis.Channel._tooloop_patched = True


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


def make_app(settings: Settings | None = None) -> Celery:
    settings = settings or get_settings()
    keys = Keys(settings.key_prefix)
    urls = celery_urls(settings.redis_url, settings.broker_url)
    backend_transport = {"global_keyprefix": keys.broker_prefix, "visibility_timeout": VISIBILITY_TIMEOUT_S,
                         **urls.backend_transport}  # fmt: skip
    if not broker.is_amqp(urls.broker):
        _patch_redis_transport()
    app = Celery("tooloop", broker=urls.broker, backend=urls.backend)
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
        result_backend_transport_options=backend_transport,
        broker_connection_retry_on_startup=True,
        # None would disable the pool: a new connection per publish (~8 ms each here).
        broker_pool_limit=256,
        # Both queues declared: a plain `celery -A worker.app worker` serves turns and tools.
        **broker.conf(keys, urls.broker, urls.broker_transport, settings.lease_s),
        task_routes={TURN_TASK: {"queue": keys.turn_queue}, TOOL_TASK: {"queue": keys.tool_queue}},
        # Task events cost ~4 Redis PUBLISHes and a fifth of a worker's CPU per task:
        # off until a monitor asks. Flower does (it broadcasts `enable_events` every 5 s,
        # its default); TOOLOOP_TASK_EVENTS=1 keeps them on for monitors that don't.
        worker_send_task_events=settings.task_events,
        task_send_sent_event=settings.task_events,
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


def app_for(settings: Settings) -> Celery:
    """This module's app if it was made with ``settings``, else one of their own: the
    module's is made once, at import, from the environment of then (a producer under
    another prefix sending through it lost every turn to queues no worker reads)."""
    return app if app.tooloop_settings == settings else make_app(settings)  # type: ignore[attr-defined]


@lru_cache(maxsize=1)
def get_store() -> RunStore:
    """This process's run store (redis-py reconnects by itself after a fork)."""
    return RunStore.from_settings(app.tooloop_settings)  # type: ignore[attr-defined]


# Each message carries its step's dispatch generation (see orchestrator/scripts.py): a
# delivery of an older one is dropped. The task id names the generation too, so the
# sweeper can tell whether a step's message still waits in its queue.
def turn_task_id(run_id: str, iteration: int, gen: int) -> str:
    return f"turn-{run_id}-{iteration}-{gen}"


def call_task_id(payload: dict[str, Any], gen: int) -> str:
    return f"tool-{payload['run_id']}-{payload['key']}-{gen}"


def call_queue(keys: Keys, payload: dict[str, Any]) -> str:
    """A call goes to its tool's own queue, consumed only by workers that have the tool;
    one the spec does not allow goes to the shared queue (any worker says UnknownTool), and
    so does a declared HTTP tool (any tool worker sends its request)."""
    own = payload.get("allowed") and not (payload.get("http") or payload.get("http_tool"))
    return keys.tool_queue_of(payload["tool"]) if own else keys.tool_queue


def enqueue_turn(run_id: str, iteration: int, gen: int, celery_app: Celery | None = None,
                 countdown: float | None = None) -> None:  # fmt: skip
    celery_app = celery_app or app
    celery_app.send_task(
        TURN_TASK,
        args=(run_id, iteration, gen),
        task_id=turn_task_id(run_id, iteration, gen),
        queue=Keys(celery_app.tooloop_settings.key_prefix).turn_queue,
        ignore_result=True,
        countdown=countdown,
    )


def enqueue_call(payload: dict[str, Any], gen: int, celery_app: Celery | None = None) -> None:
    """Send a stored call (worker/calls.py): the message names it, nothing more."""
    from worker.calls import message

    celery_app = celery_app or app
    hard_limit = payload["timeout_s"] + 60  # the sandbox cuts first; this is a backstop
    keys = Keys(celery_app.tooloop_settings.key_prefix)
    queue = call_queue(keys, payload)
    if queue not in celery_app.amqp.queues:  # a tool's own queue: declared like the shared ones
        celery_app.amqp.queues.add(broker.tool_queue(keys, celery_app.conf.broker_url or "", payload["tool"]))
    celery_app.send_task(
        TOOL_TASK,
        args=(message(payload), gen),
        task_id=call_task_id(payload, gen),
        queue=queue,
        ignore_result=True,
        time_limit=hard_limit,
        argsrepr=shown_args(payload),  # what Flower and task events show
    )


def send(dispatch: Any, celery_app: Celery | None = None) -> None:
    """Send one step message (an orchestrator.store.Dispatch)."""
    if dispatch.payload is None:
        enqueue_turn(dispatch.run_id, dispatch.iteration, dispatch.gen, celery_app)
    else:
        enqueue_call(dispatch.payload, dispatch.gen, celery_app)


def shown_args(payload: dict[str, Any]) -> str:
    """The call as monitors show it: which call, its tool and the model's arguments (sealed
    when they hold a secret), secrets masked, the length bounded like Celery's own repr."""
    from worker.calls import message

    shown = {**message(payload), "arguments": payload.get("arguments")}
    return cut_text(scrub_text(repr((shown,))), 1024)


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _scrub_logs(logger: logging.Logger, **_: Any) -> None:
    """Every handler Celery sets up masks secrets in log lines (see orchestrator.scrub)."""
    install_log_filter(logger, logging.getLogger())


from worker import observe  # noqa: E402, F401  (its Celery signals stamp trace context on every message)
