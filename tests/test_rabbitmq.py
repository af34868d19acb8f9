"""RabbitMQ as the broker: quorum queues, redelivery, the delivery limit, Flower.

The loop, durability and control suites also run on RabbitMQ (the ``amqp`` stack of
conftest.py; RabbitMQ with a Redis Cluster store: tests/test_cluster.py); these tests
cover what is RabbitMQ's own.
Each session uses a vhost of its own; skipped where RabbitMQ does not answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from kombu import Connection

from orchestrator import Status
from orchestrator.broker import DELIVERY_LIMIT, queue_arguments
from tests.helpers import call, flower, flower_task_names, once_flower_shows, tools, wait_for

# One test process runs this module (one vhost): each test's deployment declares a quorum
# queue per tool, ~3 of RabbitMQ's file handles each, and the module spread over six
# processes (six vhosts with Celery's 28 delayed-delivery queues each, on top of the amqp
# stacks') spent the 927 handles of a Debian RabbitMQ: it then accepted no connection.
pytestmark = pytest.mark.xdist_group("test_rabbitmq")


def take(url: str, queue: str):
    """A consumer that takes the queue's next message and never acks it."""
    conn = Connection(url)
    message = wait_for(lambda: conn.default_channel.basic_get(queue, no_ack=False), timeout=10)
    return conn, message


def test_turn_and_tool_queues_are_quorum_queues(deployment, amqp_url):
    d = deployment(TOOLOOP_BROKER_URL=amqp_url)
    d.start_worker("-c", "1")
    with Connection(amqp_url) as conn:
        for queue in (d.store.keys.turn_queue, d.store.keys.tool_queue):
            ours = conn.channel()
            ours.queue_declare(queue, durable=True, auto_delete=False,
                               arguments=queue_arguments(amqp_url))  # the same: accepted
            classic = conn.channel()
            with pytest.raises(conn.channel_errors, match="inequivalent arg 'x-queue-type'"):
                classic.queue_declare(queue, durable=True, auto_delete=False,
                                      arguments={"x-queue-type": "classic"})  # fmt: skip
            ours.close()


def test_a_message_held_by_a_lost_consumer_comes_back(deployment, amqp_url, spec):
    """Acks late: a consumer lost before acking hands the message back at once, and that
    redelivery carries the run (no lease had to expire, the sweeper re-sent nothing)."""
    d = deployment(TOOLOOP_BROKER_URL=amqp_url, TOOLOOP_RECOVERY_S="300")  # no lease lapses here
    handle = d.client.submit(spec([tools(call("add", {"a": 2, "b": 2})), {"content": "four"}], tools=["add"]))
    queue = d.store.keys.turn_queue
    conn, first = take(amqp_url, queue)
    assert json.loads(first.body)[0] == [handle.run_id, 1, 1] and not first.delivery_info["redelivered"]
    conn.close()  # the consumer is lost without acking
    conn, again = take(amqp_url, queue)
    assert again.delivery_info["redelivered"] and json.loads(again.body)[0] == [handle.run_id, 1, 1]
    conn.close()
    d.start_worker("-c", "2")
    result = handle.wait(timeout=40)
    assert (result.status, result.content) == (Status.completed, "four")
    assert [e.type for e in handle.events(timeout=5) if e.type == "recovery"] == []


def test_a_message_past_its_delivery_limit_is_dropped_and_the_sweeper_resends(deployment, amqp_url, spec):
    d = deployment(TOOLOOP_BROKER_URL=amqp_url)
    handle = d.client.submit(spec([{"content": "swept"}]))
    queue = d.store.keys.turn_queue
    deliveries = 0
    with Connection(amqp_url) as conn:
        channel = conn.channel()
        while (message := channel.basic_get(queue, no_ack=False)) is not None:
            deliveries += 1
            channel.basic_reject(message.delivery_tag, requeue=True)  # RabbitMQ counts a delivery
            assert deliveries <= DELIVERY_LIMIT + 1, "the delivery limit did not apply"
    assert deliveries == DELIVERY_LIMIT + 1
    assert d.queued(queue) == 0
    d.start_worker("-c", "2")
    result = handle.wait(timeout=40)
    assert (result.status, result.content) == (Status.completed, "swept")
    # re-sent by the sweeper (as often as its lease lapsed while the worker was starting)
    recovery = [e for e in handle.events(timeout=5) if e.type == "recovery"]
    assert recovery and {(e.step, e.iteration) for e in recovery} == {("turn", 1)}


def test_a_frozen_worker_hands_back_the_messages_it_holds_within_a_lease(deployment, amqp_url, spec):
    """A frozen or cut-off worker keeps the messages it took but never started until
    RabbitMQ closes its connection. The AMQP heartbeat (a third of a lease) bounds that;
    with Celery's default, RabbitMQ waited 60 s and the run with it (bench/chaos.py)."""
    d = deployment(TOOLOOP_BROKER_URL=amqp_url, TOOLOOP_RECOVERY_S="6")  # 3 s leases: 2 s heartbeat
    worker = d.start_worker("-c", "2")
    queue = d.store.keys.turn_queue

    def ready_and_consumers() -> tuple[int, int]:
        with Connection(amqp_url) as conn:
            _, ready, consumers = conn.default_channel.queue_declare(queue, passive=True)
            return ready, consumers

    worker.freeze()  # no sweeper anywhere: only RabbitMQ can hand the message back
    try:
        handle = d.client.submit(spec([{"content": "back"}]))
        wait_for(lambda: ready_and_consumers() == (0, 1), timeout=10)  # pushed to the frozen worker
        frozen = time.monotonic()
        wait_for(lambda: ready_and_consumers() == (1, 0), timeout=30)
        assert time.monotonic() - frozen < 12  # heartbeat 2 s: dropped after two missed
    finally:
        worker.thaw()
    result = handle.wait(timeout=60)  # the worker reconnects and takes it again
    assert (result.status, result.content) == (Status.completed, "back")


def test_flower_follows_a_run_over_rabbitmq_without_the_management_api(deployment, amqp_url, spec):
    """Events go over the broker (Celery's event exchange); Flower needs no --broker-api."""
    import httpx

    d = deployment(TOOLOOP_BROKER_URL=amqp_url)
    d.start_worker("-c", "2")

    def submit() -> str:
        s = spec([tools(call("add", {"a": 1, "b": 2})), {"content": "3"}], tools=["add"])
        handle = d.client.submit(s)
        assert handle.wait(timeout=30).content == "3"
        return handle.run_id

    with flower(d.env) as base:
        assert once_flower_shows(submit, lambda run_id: flower_task_names(base, run_id))
        workers = httpx.get(base + "/api/workers", params={"refresh": "true"}, timeout=10).json()
        assert any(name.startswith("tools@") for name in workers)  # remote control over the broker too


PATCHED = "import worker.app, kombu.transport.redis as r; print(getattr(r.Channel, '_tooloop_patched', 0))"


@pytest.mark.parametrize("broker, patched", [("amqp://guest:guest@127.0.0.1:5672//", "0"),
                                             ("redis://127.0.0.1:6379/0", "True")])  # fmt: skip
def test_redis_transport_workarounds_apply_only_to_a_redis_broker(broker, patched):
    env = {**os.environ, "TOOLOOP_BROKER_URL": broker}
    out = subprocess.run([sys.executable, "-c", PATCHED], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == patched


def test_celery_settings_follow_the_broker():
    from orchestrator.settings import Settings
    from worker.app import make_app

    amqp = make_app(Settings(broker_url="amqp://guest:guest@127.0.0.1:5672//", key_prefix="p",
                             recovery_s=60)).conf  # fmt: skip
    assert amqp.task_default_queue_type == "quorum"
    assert amqp.broker_transport_options == {"confirm_publish": True}
    turns = {q.name: q for q in amqp.task_queues}["p.turns"]
    assert turns.queue_arguments["x-queue-type"] == "quorum"
    assert turns.queue_arguments["x-consumer-timeout"] > 3600 * 1000
    assert turns.queue_arguments["x-delivery-limit"] == DELIVERY_LIMIT
    assert amqp.broker_heartbeat == 3  # a third of the default 10 s lease
    redis_conf = make_app(Settings(broker_url="redis://127.0.0.1:6379/0", key_prefix="p")).conf
    assert redis_conf.broker_transport_options["global_keyprefix"] == "p:celery:"
    assert all(q.queue_arguments is None for q in redis_conf.task_queues)
    # each queue has its own exchange: a turn is never copied to the tools queue
    assert {(q.exchange.name, q.exchange.type) for q in amqp.task_queues} == {("p.turns", "topic"),
                                                                              ("p.tools", "topic")}


def test_countdown_waits_in_rabbitmq_not_in_a_worker(deployment, amqp_url, spec, model_server):
    """A rate-limited turn goes back with a countdown: over RabbitMQ it waits in Celery's
    native delayed-delivery queues (our queues' topic exchanges are bound to them) and
    reaches a worker only when due, instead of being held by the worker until its ETA."""
    import re

    limits = {"models": {"*": {"rpm": 20, "burst": 1}}}  # a request every 3 s
    d = deployment(TOOLOOP_BROKER_URL=amqp_url, TOOLOOP_RATE_LIMITS=json.dumps(limits))
    worker = d.start_worker("-c", "2")
    s = spec([{"content": "ok"}])
    handles = [d.client.submit(s) for _ in range(2)]
    assert all(h.wait(timeout=60).status == Status.completed for h in handles)
    deferred = {h.run_id: e for h in handles for e in d.store.read_events(h.run_id, "0")
                if e.type == "rate_limited"}  # fmt: skip
    [(run_id, event)] = deferred.items()
    recoveries = [e for e in d.store.read_events(run_id, "0") if e.type == "recovery"]
    assert recoveries == [], "the deferred turn came back through the sweeper, not RabbitMQ"
    line = rf"\[(\S+ \S+): INFO/MainProcess\] Task tooloop.turn\[turn-{run_id}-1-\d+\] received"
    log = worker.tail(500_000)
    stamps = [seconds(m.group(1)) for m in re.finditer(line, log)]
    assert len(stamps) == 2, log[-3000:]  # delivered, deferred, delivered again when due
    # Celery's native delayed delivery counts whole seconds (int(countdown)); an ETA held
    # by the worker would have shown the second delivery at once
    assert stamps[1] - stamps[0] >= int(event.wait_ms / 1000) - 0.5, (stamps, event)


def test_a_tools_only_worker_binds_the_turn_queue_for_delayed_delivery(deployment, amqp_url):
    """Celery's native delayed delivery binds every queue's exchange when a worker starts;
    a tools-only worker first on a fresh deployment must find the turns exchange declared,
    or a countdown turn (a rate-limited one handed back) has nowhere to go."""
    from worker.app import enqueue_turn

    d = deployment(TOOLOOP_BROKER_URL=amqp_url)
    worker = d.start_worker("-Q", "tools", roles=("tools",))
    assert "Failed to bind" not in worker.tail(200_000)
    enqueue_turn("r-delayed", 1, 1, d.client.celery, countdown=1)  # no turn consumer: it waits in the queue
    wait_for(lambda: d.queued(d.store.keys.turn_queue) == 1, timeout=30)


def seconds(stamp: str) -> float:
    from datetime import datetime

    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
