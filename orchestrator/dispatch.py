"""Sending steps: the Celery app of a deployment and the messages that start a turn or a tool call.

The control plane sends tasks by name (``send_task``): a producer needs Celery's app
and this module, never the worker's code, and producers and workers of different
versions interoperate as long as the names below stay. The worker registers its
tasks under these names on the same app (``worker/app.py``).

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
  same length, publisher confirms (see ``orchestrator/broker.py``); a message held by
  a lost consumer comes back at once, and the sweeper still covers the rest.
- results ignored: the run store holds the outcome; storing task results costs
  ~1 ms CPU per task for nothing.
- task events off unless TOOLOOP_TASK_EVENTS=1 or a monitor enables them (Flower does).
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from celery import Celery, signals

from orchestrator.bounds import cut_text
from orchestrator.broker import DELIVERY_TIMEOUT_S, is_amqp, patch_redis_transport, tool_queue
from orchestrator.broker import conf as broker_conf
from orchestrator.calls import message
from orchestrator.connections import celery_urls
from orchestrator.keys import Keys
from orchestrator.scrub import scrub_text
from orchestrator.settings import Settings, get_settings
from orchestrator.telemetry import enabled as tracing
from orchestrator.telemetry import inject

if TYPE_CHECKING:
    from orchestrator.store import Dispatch

log = logging.getLogger(__name__)

TURN_TASK = "tooloop.turn"  # a turn of a run: (run_id, iteration, gen)
TOOL_TASK = "tooloop.tool"  # one tool call: (message, gen)
VISIBILITY_TIMEOUT_S = DELIVERY_TIMEOUT_S


def make_app(settings: Settings | None = None) -> Celery:
    """A Celery app for ``settings`` (default: the environment's): queues, routes, delivery."""
    settings = settings or get_settings()
    keys = Keys(settings.key_prefix)
    urls = celery_urls(settings.redis_url, settings.broker_url)
    backend_transport = {"global_keyprefix": keys.broker_prefix, "visibility_timeout": VISIBILITY_TIMEOUT_S,
                         **urls.backend_transport}  # fmt: skip
    if not is_amqp(urls.broker):
        patch_redis_transport()
    app = Celery("tooloop", broker=urls.broker, backend=urls.backend)
    app.conf.update(
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
        **broker_conf(keys, urls.broker, urls.broker_transport, settings.lease_s),
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


@lru_cache(maxsize=1)
def default_app() -> Celery:
    """This process's app, made once, on first use, from the environment of then
    (``worker.app:app`` in a worker)."""
    return make_app()


def app_for(settings: Settings) -> Celery:
    """The process's app if it was made with ``settings``, else one of their own: the
    process's is made once, from the environment of then (a producer under another
    prefix sending through it lost every turn to queues no worker reads)."""
    app = default_app()
    return app if app.tooloop_settings == settings else make_app(settings)  # type: ignore[attr-defined]


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


def message_of(keys: Keys, dispatch: Dispatch) -> tuple[str, str]:
    """(queue, task id) of a step's message."""
    if dispatch.payload is None:
        return keys.turn_queue, turn_task_id(dispatch.run_id, dispatch.iteration, dispatch.gen)
    return call_queue(keys, dispatch.payload), call_task_id(dispatch.payload, dispatch.gen)


# A queue is declared with the first message this app sends to it, not with every one:
# kombu's cached declaration still copies the queue per publish (~0.1 ms, a tenth of a
# publish). Workers declare the queues they consume on every (re)connect, so a broker that
# lost its bindings gets them back; a tool's own queue no worker serves yet is declared here.
_declared: WeakKeyDictionary[Celery, set[str]] = WeakKeyDictionary()


def _send(celery_app: Celery, name: str, queue: str, **options: Any) -> None:
    declared = _declared.setdefault(celery_app, set())
    celery_app.send_task(name, queue=queue, declare=[] if queue in declared else None, kwargsrepr="{}",
                         ignore_result=True, **options)  # fmt: skip
    declared.add(queue)


def enqueue_turn(run_id: str, iteration: int, gen: int, celery_app: Celery | None = None,
                 countdown: float | None = None) -> None:  # fmt: skip
    celery_app = celery_app or default_app()
    queue = Keys(celery_app.tooloop_settings.key_prefix).turn_queue  # type: ignore[attr-defined]
    _send(
        celery_app,
        TURN_TASK,
        queue,
        args=(run_id, iteration, gen),
        task_id=turn_task_id(run_id, iteration, gen),
        countdown=countdown,
        argsrepr=repr((run_id, iteration, gen)),  # Celery's own saferepr: ~5 % of a publish
    )


def enqueue_call(payload: dict[str, Any], gen: int, celery_app: Celery | None = None) -> None:
    """Send a stored call (worker/calls.py): the message names it, nothing more."""
    celery_app = celery_app or default_app()
    hard_limit = payload["timeout_s"] + 60  # the sandbox cuts first; this is a backstop
    keys = Keys(celery_app.tooloop_settings.key_prefix)  # type: ignore[attr-defined]
    queue = call_queue(keys, payload)
    if queue not in celery_app.amqp.queues:  # a tool's own queue: declared like the shared ones
        celery_app.amqp.queues.add(tool_queue(keys, celery_app.conf.broker_url or "", payload["tool"]))
    _send(
        celery_app,
        TOOL_TASK,
        queue,
        args=(message(payload), gen),
        task_id=call_task_id(payload, gen),
        time_limit=hard_limit,
        argsrepr=shown_args(payload),  # what Flower and task events show
    )


def send(dispatch: Dispatch, celery_app: Celery | None = None) -> None:
    """Send one step message."""
    if dispatch.payload is None:
        enqueue_turn(dispatch.run_id, dispatch.iteration, dispatch.gen, celery_app)
    else:
        enqueue_call(dispatch.payload, dispatch.gen, celery_app)


def shown_args(payload: dict[str, Any]) -> str:
    """The call as monitors show it: which call, its tool and the model's arguments (sealed
    when they hold a secret), secrets masked, the length bounded like Celery's own repr."""
    shown = {**message(payload), "arguments": payload.get("arguments")}
    return cut_text(scrub_text(repr((shown,))), 1024)


def run_of(args: Any) -> str | None:
    """The run a tooloop task's arguments belong to (a turn's first argument, a call's message)."""
    first = args[0] if isinstance(args, (list, tuple)) and args else None
    if isinstance(first, dict):
        first = first.get("run_id")
    return first if isinstance(first, str) else None


@signals.before_task_publish.connect
def _stamp(sender: str | None = None, headers: dict[str, Any] | None = None, body: Any = None,
           routing_key: str | None = None, **_: Any) -> None:  # fmt: skip
    """Every message of a run carries the run's trace: a tool call's its turn's span."""
    if headers is None or not tracing():
        return
    run_id = run_of(body[0] if isinstance(body, (list, tuple)) and body else ())
    if run_id is None or not routing_key:
        return
    # queues are <prefix>.turns / <prefix>.tools / <prefix>.tools.<tool name>
    prefix = routing_key.split(".tools.", 1)[0] if ".tools." in routing_key else routing_key.rsplit(".", 1)[0]
    try:
        inject(headers, prefix, run_id, child_of_current=sender == TOOL_TASK)
    except Exception:
        log.warning("trace context not stamped on %s", sender, exc_info=True)
