"""Traces (OpenTelemetry): one trace per run, across every process that touches it.

Spans: ``tooloop.run`` (the whole run, emitted once when it ends) > ``tooloop.turn``
> ``tooloop.model_call`` / ``tooloop.tool_call``; the producer adds ``tooloop.submit``.

A run's trace id and the id of its ``tooloop.run`` span are derived from the key
prefix and the run id, so every process -- the producer, a turn worker, a tool
worker, a sweeper re-enqueueing a lost step, the API aborting the run -- places
its spans in the run's trace without a lookup, even for messages sent without
context. The W3C ``traceparent`` header still travels in every Celery message: a
turn's message carries the run's span, a tool call's message its turn's span.

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (or a test installs a provider):
then nothing of OpenTelemetry is imported and every function returns at once. The
exporter follows the standard variables (``OTEL_EXPORTER_OTLP_PROTOCOL`` = ``grpc``
or ``http/protobuf``, ``OTEL_SERVICE_NAME``, ``OTEL_BSP_SCHEDULE_DELAY``, ...).
Spans carry no text of a run unless ``TOOLOOP_TRACE_CONTENT`` asks, and then scrubbed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

log = logging.getLogger(__name__)

TRACER_NAME = "tooloop"
ENDED = ("completed", "failed", "aborted")
TRACEPARENT = "traceparent"
CONTENT_CHARS = 4096  # at most this much text per attribute, when content tracing is on

END_MARK = "telemetry_end"  # run hash field: the run's end was counted and traced (once per run)
# Set the mark only on a run hash that still exists: an expired run must not come back as a stub.
MARK_END = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
return redis.call('HSETNX', KEYS[1], ARGV[1], '1')
"""
RUN_FIELDS = ("status", "exit", "error_type", "iteration", "tokens_used", "created_at", "ended_at",
              "tenant")  # fmt: skip

_state: dict[str, Any] = {"pid": None, "tracer": None, "provider": None}
_lock = threading.Lock()
_forced_ids: ContextVar[tuple[int, int] | None] = ContextVar("tooloop_forced_ids", default=None)


# -- ids: derived from the run, known everywhere ------------------------------------------
def run_ids(prefix: str, run_id: str) -> tuple[int, int]:
    """(trace id, id of the run's span) of one run: 128 and 64 bits, never zero."""
    digest = hashlib.blake2b(f"{prefix}\0{run_id}".encode(), digest_size=24).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:], "big") or 1
    return trace_id, span_id


def trace_id_hex(prefix: str, run_id: str) -> str:
    """The run's trace id as logs and trace viewers print it (no OpenTelemetry needed)."""
    return f"{run_ids(prefix, run_id)[0]:032x}"


# -- setup ------------------------------------------------------------------------------------
def configured() -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or
                os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))  # fmt: skip


def enabled() -> bool:
    """A provider was installed in this process, or an exporter is configured and the
    OpenTelemetry SDK is there to export with."""
    return tracer() is not None


def tracer() -> Any:
    """This process's tracer, or None when tracing is off. Set up once per process
    (a forked pool child builds its own: exporters' threads and sockets do not survive fork)."""
    if _state["pid"] == os.getpid():
        return _state["tracer"]  # set up here already (None: the SDK is missing)
    if not configured():
        return None
    with _lock:
        if _state["pid"] != os.getpid():
            provider = _provider_or_none()
            _state.update(pid=os.getpid(), provider=provider,
                          tracer=provider.get_tracer(TRACER_NAME) if provider else None)  # fmt: skip
    return _state["tracer"]


def _provider_or_none() -> Any:
    """The configured exporter's provider; None, said once, without the ``otel`` extra: a
    missing SDK turns tracing off, it does not stop a submit or a worker."""
    try:
        return make_provider(_exporter())
    except ModuleNotFoundError as exc:
        log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but OpenTelemetry is not installed (%s): "
                    "pip install 'tooloop[otel]' to export traces; running without tracing", exc)  # fmt: skip
        return None


def install(provider: Any) -> None:
    """Use this provider in this process (tests: one with an in-memory exporter)."""
    with _lock:
        _state.update(pid=os.getpid(), provider=provider, tracer=provider.get_tracer(TRACER_NAME))


def uninstall() -> None:
    with _lock:
        _state.update(pid=None, provider=None, tracer=None)


def make_provider(exporter: Any, batch: bool = True) -> Any:
    """A TracerProvider that can emit a run's span under its derived ids."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    service = os.environ.get("OTEL_SERVICE_NAME") or "tooloop"
    provider = TracerProvider(resource=Resource.create({"service.name": service}),
                              id_generator=_run_id_generator())  # fmt: skip
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    return provider


def _exporter() -> Any:
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")  # fmt: skip
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use grpc or http/protobuf")
    return OTLPSpanExporter()  # endpoint, headers, timeout: from the OTEL_* variables


def _run_id_generator() -> Any:
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class RunIdGenerator(RandomIdGenerator):
        """Random ids, except for a run's span: its derived ids, set just for that span."""

        def generate_trace_id(self) -> int:
            forced = _forced_ids.get()
            return forced[0] if forced else super().generate_trace_id()

        def generate_span_id(self) -> int:
            forced = _forced_ids.get()
            return forced[1] if forced else super().generate_span_id()

    return RunIdGenerator()


def flush(timeout_ms: int = 5000) -> None:
    provider = _state["provider"]
    if provider is not None and _state["pid"] == os.getpid():
        provider.force_flush(timeout_ms)


# -- contexts ---------------------------------------------------------------------------------
def run_context(prefix: str, run_id: str) -> Any:
    """An OpenTelemetry context whose parent is the run's span."""
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    trace_id, span_id = run_ids(prefix, run_id)
    parent = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return trace.set_span_in_context(NonRecordingSpan(parent))


def parent_context(prefix: str, run_id: str, carrier: Any) -> Any:
    """The context a message carries, if it belongs to the run's trace; else the run's."""
    from opentelemetry import trace
    from opentelemetry.propagate import extract

    fallback = run_context(prefix, run_id)
    value = _get(carrier, TRACEPARENT)
    if not value:
        return fallback
    ctx = extract({TRACEPARENT: value})
    given = trace.get_current_span(ctx).get_span_context()
    ours = run_ids(prefix, run_id)[0]
    return ctx if given.is_valid and given.trace_id == ours else fallback


def _get(carrier: Any, key: str) -> str | None:
    if isinstance(carrier, dict):
        return carrier.get(key)
    return getattr(carrier, key, None)


def inject(headers: dict[str, Any], prefix: str, run_id: str, child_of_current: bool) -> None:
    """Put ``traceparent`` in a message's headers: the current span when it belongs to the
    run's trace and ``child_of_current`` (a tool call under its turn), else the run's span."""
    from opentelemetry import trace
    from opentelemetry.propagate import inject as otel_inject

    ctx = run_context(prefix, run_id)
    if child_of_current:
        current = trace.get_current_span().get_span_context()
        if current.is_valid and current.trace_id == run_ids(prefix, run_id)[0]:
            ctx = None  # the current context
    carrier: dict[str, str] = {}
    otel_inject(carrier, context=ctx)
    headers.update({k: v for k, v in carrier.items() if k in (TRACEPARENT, "tracestate")})


# -- spans ------------------------------------------------------------------------------------
@contextlib.contextmanager
def submit_span(prefix: str, run_id: str, attributes: dict[str, Any]) -> Iterator[None]:
    """The producer's span around writing and enqueueing a run, linked to the caller's span."""
    t = tracer()
    if t is None:
        yield
        return
    from opentelemetry import trace
    from opentelemetry.trace import Link

    caller = trace.get_current_span().get_span_context()
    links = [Link(caller)] if caller.is_valid else []
    attrs = {"tooloop.run_id": run_id, **attributes}
    with t.start_as_current_span("tooloop.submit", context=run_context(prefix, run_id), links=links,
                                 attributes=attrs):  # fmt: skip
        yield


def emit_run_span(prefix: str, run_id: str, state: dict[str, str]) -> None:
    """The run's own span, under its derived ids: from creation to end, its outcome as attributes.
    Called once per run, by whichever process first sees it ended (see ``observe_end``)."""
    t = tracer()
    if t is None:
        return
    from opentelemetry.trace import SpanKind, Status, StatusCode

    start_ns = int(state.get("created_at") or 0) * 1_000_000
    end_ns = int(state.get("ended_at") or 0) * 1_000_000 or None
    token = _forced_ids.set(run_ids(prefix, run_id))
    try:
        from opentelemetry.context import Context

        span = t.start_span("tooloop.run", context=Context(), kind=SpanKind.INTERNAL,
                            start_time=start_ns or None,
                            attributes=run_attributes(run_id, state))  # fmt: skip
    finally:
        _forced_ids.reset(token)
    if state.get("status") == "failed" and state.get("exit") == "error":
        span.set_status(Status(StatusCode.ERROR, state.get("error_type") or "error"))
    span.end(end_time=end_ns)


def run_attributes(run_id: str, state: dict[str, str]) -> dict[str, Any]:
    attrs: dict[str, Any] = {"tooloop.run_id": run_id}
    for field, attr, kind in (("status", "tooloop.status", str), ("exit", "tooloop.exit", str),
                              ("error_type", "error.type", str), ("tenant", "tooloop.tenant", str),
                              ("iteration", "tooloop.iterations", int),
                              ("tokens_used", "tooloop.tokens", int)):  # fmt: skip
        value = state.get(field)
        if value not in (None, ""):
            attrs[attr] = kind(value)
    return attrs


def scrub(text: str) -> str:
    """Text for a span attribute: credentials masked (as everywhere tooloop keeps text), length capped."""
    from orchestrator.scrub import scrub_text

    return scrub_text(text)[:CONTENT_CHARS]
