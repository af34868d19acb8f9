"""Prometheus metrics of a real worker (all its pool processes) and run-tagged JSON logs."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator import Status, control, telemetry
from orchestrator.local import free_port
from tests.helpers import call, gate, tools, wait_for


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_scrape_after_a_run_shows_the_counters_moved(deployment, spec, holds) -> None:
    d = deployment()
    port = free_port()
    d.start_worker("--metrics-port", str(port))
    # ready once every pool process (turns, turns.2..., tools) has registered
    wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200, timeout=60)
    before = scrape(port)
    assert value(before, "tooloop_runs_started_total") == 0 and value(before, "tooloop_redis_up") == 1

    steps = [tools(call("add", {"a": 1, "b": 2}), call("boom", {"message": "no"}), tokens=40),
             {"content": "3", "tokens": 25}]  # fmt: skip
    s = spec(steps, tools=["add", "boom"])
    result = d.client.submit(s).wait(timeout=60)
    assert result.status == Status.completed and result.tokens_used == 65
    model = s["model"]
    after = wait_for(lambda: (m := scrape(port)) and value(m, "tooloop_runs_ended_total", status="completed",
                                                           exit="default") == 1 and m)  # fmt: skip
    assert value(after, "tooloop_runs_started_total") == 1
    assert value(after, "tooloop_turns_total", model=model) == 2
    assert value(after, "tooloop_tokens_total", model=model) == 65
    assert value(after, "tooloop_tool_calls_total", tool="add", result="ok") == 1
    assert value(after, "tooloop_tool_calls_total", tool="boom", result="error") == 1
    assert value(after, "tooloop_model_latency_seconds_count", model=model, result="ok") == 2
    assert value(after, "tooloop_turn_duration_seconds_count", model=model) == 2
    assert value(after, "tooloop_tool_duration_seconds_count", tool="add") == 1
    assert value(after, "tooloop_queue_depth", queue=f"{d.prefix}.turns") == 0
    assert ("tooloop_queue_depth", (("queue", f"{d.prefix}.tools"),)) in after

    # live and paused runs, read from Redis at scrape time; an abort is counted once
    held = gate(holds)
    s2 = spec([tools(call("add", {"a": 1, "b": 1}), hold=held), {"content": "never"}], tools=["add"])
    handle = d.client.submit(s2)
    wait_for(lambda: handle.status() == Status.running)
    assert control.pause(d.store, handle.run_id) == "ok"
    paused = scrape(port)
    assert value(paused, "tooloop_live_runs") == 1 and value(paused, "tooloop_paused_runs") == 1
    control.abort(d.store, handle.run_id, reason="test")
    held.set()  # the turn's reply is discarded; its task sees the run ended
    ended = wait_for(lambda: (m := scrape(port)) and value(m, "tooloop_runs_ended_total", status="aborted",
                                                           exit="aborted") == 1 and m)  # fmt: skip
    assert value(ended, "tooloop_live_runs") == 0 and value(ended, "tooloop_paused_runs") == 0
    assert value(ended, "tooloop_model_latency_seconds_count", model=s2["model"], result="error") == 1


def test_the_queue_depth_counts_what_waits(deployment, spec) -> None:
    """No worker consumes here: submitted turns and pushed tool calls stay in their lists."""
    from orchestrator.metrics import KOMBU_PRIORITY_SEP, exposition, registry

    d = deployment()
    keys, r = d.store.keys, d.store.redis
    for _ in range(3):
        d.client.submit(spec([{"content": "never run"}]))
    # a tool worker that published `add` (so its calls wait in their own list), now away
    d.store.publish_worker(f"{d.prefix}-gone", {"tools": [{"name": "add"}]})
    own = keys.broker_prefix + keys.tool_queue_of("add")
    own_priority = f"{own}{KOMBU_PRIORITY_SEP}3"
    shared = keys.broker_prefix + keys.tool_queue
    lists = (own, own_priority, shared, keys.broker_prefix + keys.turn_queue)
    try:
        r.lpush(own, "call-1", "call-2")
        r.lpush(own_priority, "call-3")
        r.lpush(shared, "call-4")
        text = exposition(registry(d.settings, multiprocess=False))[0].decode()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip
        assert value(samples, "tooloop_queue_depth", queue=keys.turn_queue) == 3
        assert value(samples, "tooloop_queue_depth", queue=keys.tool_queue) == 4  # 3 own + 1 shared
        assert value(samples, "tooloop_live_runs") == 3
    finally:
        r.delete(*lists)
        d.store.remove_worker(f"{d.prefix}-gone")


def test_a_lost_turn_is_recovered_and_counted(deployment, spec) -> None:
    d = deployment(TOOLOOP_RECOVERY_S="2")
    handle = d.client.submit(spec([{"content": "recovered"}]))
    queue = d.store.keys.broker_prefix + d.store.keys.turn_queue
    assert d.store.redis.delete(queue) == 1  # the turn's message is lost
    port = free_port()
    d.start_worker("--metrics-port", str(port))
    assert handle.wait(timeout=60).content == "recovered"
    # each re-enqueue is counted, as the run's events record them (the sweeper re-sends the
    # turn every lease until a turn pool, still importing litellm, claims it)
    recoveries = [e for e in handle.events() if e.type == "recovery" and e.step == "turn"]
    assert recoveries
    wait_for(lambda: value(scrape(port), "tooloop_recoveries_total", step="turn") == len(recoveries))


def test_healthz_fails_when_a_pool_is_not_running(deployment) -> None:
    d = deployment()
    port = free_port()
    proc = d.start_worker("-Q", "tools", "--metrics-port", str(port), roles=("tools",))
    health = f"http://127.0.0.1:{port}/healthz"
    wait_for(lambda: httpx.get(health, timeout=10).text.strip() == "ok", timeout=60)
    # the Celery worker's main process: the launcher's child (its pool children are its own)
    found = subprocess.run(["pgrep", "-P", str(proc.proc.pid), "-f", f"tools@{proc.name}"],
                           capture_output=True, text=True)  # fmt: skip
    main, = (int(pid) for pid in found.stdout.split())
    os.kill(main, signal.SIGSTOP)  # the pool stops answering; the launcher sees it alive
    try:
        # alive but silent: its registration lapses (Redis registry TTL), so /healthz says so
        reply = wait_for(lambda: (r := httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10)).status_code
                         == 503 and r, timeout=60)  # fmt: skip
        assert "not registered" in reply.text
    finally:
        os.kill(main, signal.SIGCONT)


@pytest.mark.parametrize("fmt", ["json"])
def test_json_logs_carry_the_run(deployment, spec, fmt: str) -> None:
    d = deployment(TOOLOOP_LOG_FORMAT=fmt)
    proc = d.start_worker("-l", "info")
    handle = d.client.submit(spec([tools(call("add", {"a": 2, "b": 2})), {"content": "4"}], tools=["add"]))
    assert handle.wait(timeout=60).content == "4"
    trace_id = telemetry.trace_id_hex(d.prefix, handle.run_id)

    def ours() -> list[dict]:
        lines = [line for line in proc.tail(200_000).splitlines() if handle.run_id in line]
        parsed = [json.loads(line) for line in lines]  # every line about the run is one JSON object
        return parsed if sum("succeeded" in p["message"] for p in parsed) >= 3 else []

    lines = wait_for(ours, timeout=20)
    assert all(p["run_id"] == handle.run_id and p["trace_id"] == trace_id for p in lines)
    assert {p["level"] for p in lines} <= {"info", "warning", "debug"}
    done = [p for p in lines if "succeeded" in p["message"]]
    assert sorted(p["iteration"] for p in done) == [1, 1, 2]  # turn 1, its tool call, turn 2
    assert [p["tool"] for p in done if p.get("tool")] == ["add"]
    received = [p for p in lines if "received" in p["message"]]
    assert received and all("iteration" in p for p in received)  # tagged from the task id


def test_the_observability_page_names_every_metric() -> None:
    """Every metric a worker counts and every fleet gauge is in docs/observability.md's table,
    and the page names no metric that does not exist."""
    import re

    from orchestrator import metrics
    from tests.conftest import ROOT

    counted = {m._name for m in vars(metrics.metrics()).values()}
    source = (ROOT / "orchestrator" / "metrics.py").read_text()
    fleet = set(re.findall(r'(?:Gauge|Counter)MetricFamily\(\s*"(tooloop_\w+)"', source))
    assert {"tooloop_queue_depth", "tooloop_live_runs", "tooloop_paused_runs", "tooloop_redis_up"} <= fleet
    page = (ROOT / "docs" / "observability.md").read_text()
    named = {re.sub(r"_total$", "", n) for n in re.findall(r"`(tooloop_\w+)`", page)}
    assert counted | fleet == named


def test_doctor_counts_what_waits_on_a_redis_broker(deployment, spec, capsys) -> None:
    """kombu's passive ``queue_declare`` asks ``EXISTS`` without the broker's key prefix, so
    it found no queue and doctor said 0 whatever waited: count the lists themselves."""
    from orchestrator.doctor import diagnose, render

    d = deployment()  # no worker: what is sent stays queued
    keys, r = d.store.keys, d.store.redis
    for _ in range(2):
        d.client.submit(spec([{"content": "never run"}]))
    d.store.publish_worker(f"{d.prefix}-gone", {"tools": [{"name": "add"}]})
    own, shared = keys.broker_prefix + keys.tool_queue_of("add"), keys.broker_prefix + keys.tool_queue
    try:
        r.lpush(own, "call-1", "call-2")
        r.lpush(shared, "call-3")
        report = diagnose(d.store)
        assert report["queues"] == {keys.turn_queue: 2, keys.tool_queue: 3}  # the tools' own queues too
        render(report)  # and as `tooloop doctor` prints them
        printed = capsys.readouterr().out.splitlines()
        assert f"queue {keys.turn_queue}: 2 waiting" in printed, printed
        assert f"queue {keys.tool_queue}: 3 waiting" in printed, printed
        assert d.queued(keys.turn_queue) == 2  # orchestrator.broker.queue_depths (the sweeper's, on AMQP)
    finally:
        r.delete(own, shared)
        d.store.remove_worker(f"{d.prefix}-gone")
