"""Prometheus metrics: what the workers count, and the fleet's state read from Redis.

Workers count into ``prometheus_client`` metrics. ``tooloop worker --metrics-port``
sets ``PROMETHEUS_MULTIPROC_DIR`` for its pools (each prefork child and each turn
process writes its own file) and serves their sum, with the fleet gauges, from the
launcher. Without it nothing is counted (``counting()`` is False) and
``prometheus_client`` is not even imported. The API's ``/metrics`` serves the
fleet gauges and what the API process itself counts.

The fleet gauges (queue depth, live and paused runs) are read from Redis at scrape
time, so every endpoint shows the same fleet-wide value: aggregate them with
``max``, not ``sum``.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.settings import Settings

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
MODEL_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300)
TOOL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
TURN_BUCKETS = MODEL_BUCKETS
PAUSED_SCAN_LIMIT = 10_000  # live runs whose status a scrape reads, at most


def counting() -> bool:
    """Whether this process counts: a worker started with --metrics-port, or the API."""
    return bool(os.environ.get(MULTIPROC_ENV)) or _api_counting


_api_counting = False


def count_here() -> None:
    """Count in this (single) process without multiprocess mode: the API."""
    global _api_counting
    _api_counting = True


class Metrics:
    """The metrics a worker process counts (names are part of the public reference)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Histogram

        self.runs_started = Counter("tooloop_runs_started", "Runs whose first turn started")
        self.runs_ended = Counter("tooloop_runs_ended", "Runs ended, by status and exit", ["status", "exit"])
        self.turns = Counter("tooloop_turns", "Turns executed (claimed and run), by model", ["model"])
        self.turn_seconds = Histogram("tooloop_turn_duration_seconds", "Wall-clock time of one turn",
                                      ["model"], buckets=TURN_BUCKETS)  # fmt: skip
        self.model_seconds = Histogram("tooloop_model_latency_seconds",
                                       "One model call, until its reply is recorded", ["model", "result"],
                                       buckets=MODEL_BUCKETS)  # fmt: skip
        self.tokens = Counter("tooloop_tokens", "Tokens of recorded model replies", ["model"])
        self.tool_calls = Counter("tooloop_tool_calls", "Tool calls recorded, by tool and result",
                                  ["tool", "result"])  # fmt: skip
        self.tool_seconds = Histogram("tooloop_tool_duration_seconds", "One tool call in its sandbox",
                                      ["tool"], buckets=TOOL_BUCKETS)  # fmt: skip
        self.recoveries = Counter("tooloop_recoveries", "Lost steps re-enqueued by the sweeper", ["step"])


@lru_cache(maxsize=1)
def metrics() -> Metrics:
    return Metrics()


def get() -> Metrics | None:
    """This process's metrics, or None when it does not count."""
    return metrics() if counting() else None


def count_recovery(turn: bool, calls: int) -> None:
    m = get()
    if m is not None:
        if turn:
            m.recoveries.labels("turn").inc()
        if calls:
            m.recoveries.labels("tool_call").inc(calls)


# -- the fleet, read from Redis at scrape time ------------------------------------------------
class FleetCollector:
    """Queue depth per queue, live and paused runs: one Redis round trip or two per scrape."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._redis: Any = None
        self._store: Any = None  # a RunStore, made when fair share is configured

    def describe(self) -> list[Any]:
        return []  # collected on demand only: registering must not touch Redis

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        from orchestrator.keys import Keys

        keys = Keys(self.settings.key_prefix)
        depth = GaugeMetricFamily("tooloop_queue_depth", "Messages waiting in each queue", labels=["queue"])
        up = GaugeMetricFamily("tooloop_redis_up", "1 when the run store answered this scrape")
        try:
            for queue, waiting in queue_depths(self.settings, self._client()).items():
                depth.add_metric([queue], waiting)
            live, paused = self._runs(keys)
        except Exception:  # Redis away: say so, and serve the other metrics
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield depth
        yield GaugeMetricFamily("tooloop_live_runs", "Runs not ended (queued, running or paused)", value=live)
        yield GaugeMetricFamily("tooloop_paused_runs", "Runs paused", value=paused)
        yield from self._tenants()

    def _tenants(self) -> Any:
        """Under fair share (orchestrator/fairshare.py): each tenant's runs holding a slot,
        its runs waiting, and the tokens its runs recorded; nothing when it is off."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        import orchestrator.fairshare as fairshare

        if fairshare.Policy.from_settings(self.settings) is None:
            return
        if self._store is None:
            from orchestrator.store import RunStore

            self._store = RunStore.from_settings(self.settings)
        fair = fairshare.of(self._store)
        assert fair is not None
        active = GaugeMetricFamily("tooloop_tenant_active", "Runs of the tenant holding a slot",
                                   labels=["tenant"])  # fmt: skip
        waiting = GaugeMetricFamily("tooloop_tenant_waiting", "Runs of the tenant waiting for its share",
                                    labels=["tenant"])  # fmt: skip
        tokens = CounterMetricFamily("tooloop_tenant_tokens", "Model tokens recorded by the tenant's runs",
                                     labels=["tenant"])  # fmt: skip
        for share in fair.shares():
            active.add_metric([share.tenant], share.active)
            waiting.add_metric([share.tenant], share.waiting)
            tokens.add_metric([share.tenant], share.tokens_total)
        yield from (active, waiting, tokens)

    def _client(self) -> Any:
        if self._redis is None:
            import redis

            self._redis = redis.Redis.from_url(self.settings.redis_url, socket_timeout=5)
        return self._redis

    def _runs(self, keys: Any) -> tuple[int, int]:
        """Live runs are those with a lease (in every shard); their status says which are paused."""
        from orchestrator.keys import SHARDS

        r = self._client()
        pipe = r.pipeline(transaction=False)
        for shard in range(SHARDS):
            pipe.zrange(keys.leases(shard), 0, PAUSED_SCAN_LIMIT // SHARDS - 1)
        ids = [run_id for rows in pipe.execute() for run_id in rows]
        pipe = r.pipeline(transaction=False)
        for run_id in ids:
            pipe.hget(keys.run(run_id.decode()), "status")
        statuses = [s.decode() if s else "" for s in pipe.execute()] if ids else []
        live = [s for s in statuses if s in ("queued", "running", "paused")]
        return len(live), live.count("paused")


KOMBU_PRIORITY_SEP, KOMBU_PRIORITIES = "\x06\x16", (0, 3, 6, 9)  # kombu's Redis queue layout


def queue_depths(settings: Settings, client: Any = None) -> dict[str, int]:
    """Messages waiting per queue: the Redis lists behind kombu's queues (all priorities),
    or, for an AMQP broker, the queue's message count. The tools queue counts its
    per-tool queues too (a call waits in its tool's own queue: see worker.app.call_queue)."""
    from orchestrator.keys import Keys

    keys = Keys(settings.key_prefix)
    per_tool = tuple(keys.tool_queue_of(name) for name in _tool_names(settings, keys, client))
    queues = (keys.turn_queue, keys.tool_queue, *per_tool)
    if not settings.broker.startswith(("redis", "rediss")):
        depths = _amqp_depths(settings.broker, queues)
    else:
        import redis

        r = client if settings.broker == settings.redis_url and client is not None else (
            redis.Redis.from_url(settings.broker, socket_timeout=5))
        pipe = r.pipeline(transaction=False)
        for queue in queues:
            for pri in KOMBU_PRIORITIES:
                name = queue if pri == 0 else f"{queue}{KOMBU_PRIORITY_SEP}{pri}"
                pipe.llen(keys.broker_prefix + name)
        sizes = pipe.execute()
        step = len(KOMBU_PRIORITIES)
        depths = {queue: sum(sizes[i * step:(i + 1) * step]) for i, queue in enumerate(queues)}
    tools = sum(depths.pop(queue, 0) for queue in per_tool)
    return {keys.turn_queue: depths[keys.turn_queue], keys.tool_queue: depths[keys.tool_queue] + tools}


def _tool_names(settings: Settings, keys: Any, client: Any) -> set[str]:
    """Every tool a registered worker publishes (each has its own queue)."""
    import json

    import redis

    r = client or redis.Redis.from_url(settings.redis_url, socket_timeout=5)
    names: set[str] = set()
    for raw in r.hvals(keys.workers()):
        names.update(tool["name"] for tool in json.loads(raw).get("tools", []))
    return names


def _amqp_depths(url: str, queues: tuple[str, ...]) -> dict[str, int]:
    from kombu import Connection

    out = {}
    with Connection(url, connect_timeout=5) as conn:
        for queue in queues:
            try:
                out[queue] = conn.channel().queue_declare(queue, passive=True).message_count
            except conn.channel_errors:  # not declared yet: nothing waits in it
                out[queue] = 0
    return out


# -- serving ------------------------------------------------------------------------------------
def registry(settings: Settings, multiprocess: bool) -> Any:
    """The fleet gauges, with every pool process's metrics (a worker) or this process's (the API)."""
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client import multiprocess as mp

    reg = CollectorRegistry()
    if multiprocess:
        mp.MultiProcessCollector(reg)
    else:
        reg.register(_Forward(REGISTRY))
    reg.register(FleetCollector(settings))
    return reg


class _Forward:
    """This process's default registry, served inside another registry."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        return self.source.collect()


def exposition(reg: Any) -> tuple[bytes, str]:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(reg), CONTENT_TYPE_LATEST


def multiproc_dir(given: str | None) -> str:
    """The folder pool processes write their metrics to, emptied: counts start from zero."""
    import tempfile
    from pathlib import Path

    folder = Path(given) if given else Path(tempfile.mkdtemp(prefix="tooloop-metrics-"))
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.db"):
        stale.unlink()
    return str(folder)


def serve(port: int, settings: Settings, healthy: Any, host: str = "0.0.0.0") -> Any:
    """``/metrics`` (every pool process, summed, with the fleet gauges) and ``/healthz``
    (``healthy()`` -> (ok, reason)) on a thread of the calling process; returns the server."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    reg = registry(settings, multiprocess=True)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, ctype, code = *exposition(reg), 200
            elif path == "/healthz":
                ok, reason = healthy()
                body, ctype, code = reason.encode() + b"\n", "text/plain", 200 if ok else 503
            else:
                body, ctype, code = b"not found\n", "text/plain", 404
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # scrapes every few seconds: not worth a line
            return None

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="tooloop-metrics", daemon=True).start()
    return server
