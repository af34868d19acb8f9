"""What depends on the broker: RabbitMQ (AMQP) or Redis (kombu's Redis transport).

RabbitMQ: the turn and tool queues are **quorum queues** (replicated, durable,
with a delivery count):
- ``x-delivery-limit``: a message returned this many times (its consumer lost,
  e.g. a worker killed while holding it) is dropped instead of looping; the
  step it carried is still in Redis under a lease, so the sweeper re-sends it.
- ``x-consumer-timeout``: a delivery unacked for longer closes its channel. Tool
  tasks are acked after they ran (acks-late), so it must outlast the longest
  tool call; the queue argument is honoured from RabbitMQ 3.11.15/3.12 on, older
  servers only have the server-wide ``consumer_timeout`` (rabbitmq.conf, default
  30 min): deploy/rabbitmq.conf sets both to the same bound.
- quorum queues have no global QoS: Celery (``worker_detect_quorum_queues``)
  then sets the prefetch per consumer, which is what prefetch multiplier 1 wants.
- publisher confirms: a send returns once RabbitMQ has the message.
- every queue is declared when a worker starts (``declare_all``), not only the queues
  it consumes: Celery's native delayed delivery binds *every* queue's exchange at start,
  and a turns-only or tools-only worker on a fresh vhost would otherwise fail to bind
  the other queue's exchange (its countdowns then had nowhere to go).

Redis: kombu's own transport options (key prefix, visibility timeout) and two
workarounds for its transport (``patch_redis_transport``); none of them applies to AMQP.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any
from urllib.parse import urlsplit

from kombu import Exchange, Queue
from kombu.transport import redis as kombu_redis

from orchestrator.keys import Keys

log = logging.getLogger(__name__)

AMQP_SCHEMES = frozenset({"amqp", "amqps", "pyamqp"})
# A broker message held unacked this long is presumed lost by the transport (the
# lease sweeper usually re-sends the step long before). Far above any tool call.
DELIVERY_TIMEOUT_S = 6 * 3600
DELIVERY_LIMIT = 5  # deliveries of one message (RabbitMQ quorum queues)


def redis_of(store: Any) -> Any:
    """The broker's Redis client, for scripts run on its queues (JUMP, the sweeper's look for
    a message): the store's own when they are one Redis (whatever its URL form: sentinel), a
    new client for another Redis, None for RabbitMQ. Callers keep what it returns."""
    url, settings = store.settings.broker, store.settings
    if url == settings.redis_url:
        return store.redis
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return None
    import redis

    return redis.Redis.from_url(url, socket_timeout=30)


def is_amqp(url: str) -> bool:
    return urlsplit(url).scheme in AMQP_SCHEMES


def queue_arguments(broker_url: str) -> dict[str, Any] | None:
    if not is_amqp(broker_url):
        return None
    return {
        "x-queue-type": "quorum",
        "x-delivery-limit": DELIVERY_LIMIT,
        "x-consumer-timeout": DELIVERY_TIMEOUT_S * 1000,
    }


def queues(keys: Keys, broker_url: str) -> list[Queue]:
    """The turn and tool queues, declared by every worker and producer."""
    arguments = queue_arguments(broker_url)
    # An exchange per queue: with Celery's default, both queues would be bound to the
    # turns queue's exchange and key, and RabbitMQ would copy every turn to the tools queue.
    # Topic on RabbitMQ: Celery's native delayed delivery (countdown/ETA with quorum
    # queues) binds only topic exchanges, and warns at every start about direct ones.
    return [_queue(name, arguments) for name in (keys.turn_queue, keys.tool_queue)]


def tool_queue(keys: Keys, broker_url: str, tool: str) -> Queue:
    """One tool's own queue (a call goes only to workers that have its tool), declared
    like the shared ones: its own exchange, quorum on RabbitMQ."""
    return _queue(keys.tool_queue_of(tool), queue_arguments(broker_url))


def _queue(name: str, arguments: dict[str, Any] | None) -> Queue:
    kind = "topic" if arguments else "direct"
    return Queue(name, Exchange(name, type=kind), routing_key=name, queue_arguments=arguments)


def conf(keys: Keys, broker_url: str, transport: dict[str, Any] | None = None,
         lease_s: float = 30.0) -> dict[str, Any]:  # fmt: skip
    """The Celery settings that depend on the broker (``transport``: options its URL needs)."""
    common = {"task_queues": queues(keys, broker_url), "task_default_queue": keys.turn_queue}
    if is_amqp(broker_url):
        return {
            **common,
            "task_default_queue_type": "quorum",
            "worker_detect_quorum_queues": True,
            "broker_heartbeat": heartbeat_s(lease_s),
            "broker_transport_options": {"confirm_publish": True, **(transport or {})},
        }
    return {
        **common,
        "broker_transport_options": {
            "global_keyprefix": keys.broker_prefix,
            "visibility_timeout": DELIVERY_TIMEOUT_S,
            **(transport or {}),
        },
    }


def heartbeat_s(lease_s: float) -> int:
    """The AMQP heartbeat a worker asks for: a third of a lease, 2..60 s.

    Messages a worker holds unacked but has not started (its prefetch; a turn pool
    holds many) come back to the queue only when RabbitMQ closes its connection, and
    the sweeper leaves them alone while they may be in a queue. With Celery's default
    (120 s, cut to RabbitMQ's 60 s) a frozen or cut-off worker's runs stalled 2 minutes
    and more in ``bench/chaos.py --broker amqp://``; a third of the lease drops the
    connection about when the steps it had started are due for recovery anyway."""
    return int(min(60, max(2, lease_s / 3)))


def queue_depths(app: Any, names: list[str]) -> dict[str, int | None]:
    """Messages waiting in each queue, whatever the broker (None: not declared yet, AMQP).

    On Redis a queue is a list per priority: kombu's *passive* declare checks ``EXISTS``
    without the transport's ``global_keyprefix`` (kombu 5.7), so it never found ours and
    every queue read as empty. A plain declare there only notes the queue in the channel
    and counts the prefixed lists (``LLEN``), every priority included."""
    passive = is_amqp(app.conf.broker_url or "")
    depths: dict[str, int | None] = {}
    with app.connection_for_read() as conn:
        for name in names:
            channel = conn.channel()  # a channel per look: AMQP closes it on a missing queue
            try:
                depths[name] = channel.queue_declare(name, passive=passive).message_count
            except conn.channel_errors:  # never declared (Redis: no message waiting)
                depths[name] = None
            finally:
                with contextlib.suppress(*conn.channel_errors):
                    channel.close()
    return depths


def purge(app: Any, name: str) -> int:
    """Drop every message waiting in one queue; returns how many."""
    with app.connection_for_write() as conn:
        return conn.default_channel.queue_purge(name) or 0


def declare_all(app: Any) -> None:
    """Declare every task queue with its exchange and binding (idempotent)."""
    with app.connection_for_write() as conn:
        for queue in app.amqp.queues.values():
            queue(conn.default_channel).declare()


def patch_redis_transport() -> None:
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
