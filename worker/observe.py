"""Traces, metrics and run-tagged logs of the turn and tool tasks, from the outside.

Nothing here is a branch of the turn or tool task: Celery signals open and close a
scope around each tooloop task (``task_prerun`` / ``task_postrun``; each message sent
carries its run's trace context: ``orchestrator/dispatch.py``), and two middleware classes
see the inside of a turn -- ``TurnTelemetry`` first in the chain (the turn was
claimed), ``ModelTelemetry`` last (the model call starts after every other
``before_model`` hook, and its reply was recorded when the first ``after_turn`` runs).

With no exporter configured and no ``--metrics-port``, every hook returns at once
and nothing more is read from Redis; logs are tagged with the run either way.
"""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from celery import signals

from orchestrator import logs, metrics, telemetry
from orchestrator.dispatch import TOOL_TASK, TURN_TASK, run_of
from orchestrator.keys import call_key
from orchestrator.models import Status
from orchestrator.observation import observe_end, observing
from orchestrator.settings import get_settings
from orchestrator.store import Finish
from worker import deferred
from worker.middleware import Middleware, TurnContext
from worker.runtime import get_store
from worker.steps import RunTools

log = logging.getLogger(__name__)





@dataclass
class Scope:
    """One tooloop task being executed in this thread: what its spans and metrics need."""

    kind: str  # turn | tool | judge...
    run_id: str
    prefix: str
    iteration: int | None
    key: str | None = None  # a tool call's key in its run
    tool: str | None = None
    headers: Any = None  # the task's request: its message headers, for the traceparent
    started: float = field(default_factory=time.monotonic)
    span: Any = None
    span_token: Any = None
    model_span: Any = None
    model: str = ""
    model_started: float = 0.0
    claimed: bool = False
    recorded_before: bool = False


_scope: ContextVar[Scope | None] = ContextVar("tooloop_scope", default=None)
_log_token: ContextVar[Any] = ContextVar("tooloop_log_token", default=None)


# -- tasks ------------------------------------------------------------------------------------
@signals.task_prerun.connect
def _enter(task: Any = None, args: Any = None, **_: Any) -> None:
    run_id = run_of(args)
    if task is None or run_id is None or not task.name.startswith("tooloop."):
        return
    scope = _scope_for(task, run_id, args)
    _log_token.set(logs.bind(scope.prefix, run_id, scope.iteration, scope.tool))
    if not observing():
        return
    _scope.set(scope)
    try:
        if scope.kind == "tool":
            _enter_tool(scope)
        elif scope.kind != "turn":  # a judge or another per-run task: a span under the run
            _start_span(scope, f"tooloop.{scope.kind}")
    except Exception:
        log.warning("telemetry: entering %s failed", task.name, exc_info=True)


def _scope_for(task: Any, run_id: str, args: Any) -> Scope:
    prefix = get_store().keys.prefix
    kind = {TURN_TASK: "turn", TOOL_TASK: "tool"}.get(task.name, task.name.removeprefix("tooloop."))
    first = args[0]
    if isinstance(first, dict):  # a tool call's payload
        iteration = first.get("iteration")
        key = first.get("key") or (call_key(iteration, first["index"]) if "index" in first else None)
        return Scope(kind, run_id, prefix, iteration, key=key, tool=first.get("tool"), headers=task.request)
    iteration = args[1] if len(args) > 1 and isinstance(args[1], int) else None
    return Scope(kind, run_id, prefix, iteration, headers=task.request)


def _enter_tool(scope: Scope) -> None:
    store = get_store()
    # A delivery of a call already recorded is a duplicate: no span, nothing counted.
    scope.recorded_before = bool(scope.key and store.redis.hexists(store.keys.calls(scope.run_id), scope.key))
    if not scope.recorded_before:
        _start_span(scope, "tooloop.tool_call", {"tooloop.tool": scope.tool or "", "tooloop.call": scope.key})


@signals.task_postrun.connect
def _leave(task: Any = None, **_: Any) -> None:
    token = _log_token.get()
    if token is not None:
        logs.unbind(token)
        _log_token.set(None)
    scope = _scope.get()
    if scope is None:
        return
    _scope.set(None)
    future = deferred.deferred()
    if future is not None and not future.done():  # the turn goes on on the event loop
        _detach(scope)  # here, in the context it was attached in; the turn's own copy keeps it
        future.add_done_callback(lambda _: _close(scope, task))
        return
    try:
        _close(scope, task)
    finally:
        _detach(scope)


def _close(scope: Scope, task: Any) -> None:
    try:
        _finish(scope)
    except Exception:
        log.warning("telemetry: leaving %s failed", getattr(task, "name", "?"), exc_info=True)


def _detach(scope: Scope) -> None:
    if scope.span_token is not None:
        from opentelemetry import context

        token, scope.span_token = scope.span_token, None
        context.detach(token)


def _finish(scope: Scope) -> None:
    store = get_store()
    pipe = store.redis.pipeline(transaction=False)
    pipe.hmget(store.keys.run(scope.run_id), telemetry.RUN_FIELDS)
    if scope.kind == "tool" and scope.key:
        pipe.hget(store.keys.calls(scope.run_id), scope.key)
    replies = pipe.execute()
    state = {k: v.decode() for k, v in zip(telemetry.RUN_FIELDS, replies[0], strict=True) if v is not None}
    if scope.kind == "tool":
        _finish_tool(scope, replies[1] if len(replies) > 1 else None)
    elif scope.kind == "turn":
        _finish_turn(scope, state)
    if scope.span is not None:
        if scope.kind != "tool":
            scope.span.set_attributes(_ending(state))
        scope.span.end()
    observe_end(store, scope.run_id, state)


def _finish_tool(scope: Scope, raw: bytes | None) -> None:
    if scope.recorded_before or raw is None:  # a duplicate, or the call was not recorded (run ended)
        return
    record = json.loads(raw)
    tool, ok = record.get("tool_name") or scope.tool or "", bool(record.get("success"))
    m = metrics.get()
    if m is not None:
        m.tool_calls.labels(tool, "ok" if ok else "error").inc()
        m.tool_seconds.labels(tool).observe(float(record.get("duration_ms") or 0) / 1000)
    if scope.span is not None:
        scope.span.set_attributes({"tooloop.tool": tool, "tooloop.success": ok,
                                   "tooloop.duration_ms": float(record.get("duration_ms") or 0)})  # fmt: skip
        if not ok:
            _fail(scope.span, _error_type(record.get("error") or ""))


def _finish_turn(scope: Scope, state: dict[str, str]) -> None:
    if not scope.claimed:
        return
    if scope.model_span is not None:  # the reply was not recorded: the call failed, or the run ended
        ended = Status(state["status"]).ended if state.get("status") else True
        _end_model(scope, tokens=None, error=state.get("error_type") if ended else "Discarded")
    m = metrics.get()
    if m is not None:
        m.turn_seconds.labels(scope.model).observe(time.monotonic() - scope.started)


def _ending(state: dict[str, str]) -> dict[str, Any]:
    """What a turn's span says about the run it may have ended."""
    status = state.get("status", "")
    out: dict[str, Any] = {"tooloop.run_status": status}
    if status and Status(status).ended:
        out["tooloop.exit"] = state.get("exit", "")
        if state.get("error_type"):
            out["error.type"] = state["error_type"]
    return out


# -- inside a turn ------------------------------------------------------------------------------
class TurnTelemetry(Middleware):
    """First in the chain: the turn was claimed, its span starts (current until the task ends,
    so the tool calls it dispatches are its children)."""

    def before_turn(self, ctx: TurnContext) -> Finish | None:
        scope = _scope.get()
        if scope is None or scope.kind != "turn":
            return None
        scope.claimed, scope.model = True, ctx.spec.model
        scope.iteration = ctx.iteration
        _start_span(scope, "tooloop.turn", {"tooloop.model": ctx.spec.model}, current=True)
        m = metrics.get()
        if m is not None:
            m.turns.labels(ctx.spec.model).inc()
            if ctx.iteration == 1:
                m.runs_started.inc()
        return None


class ModelTelemetry(Middleware):
    """Last in the chain: the model call's span and latency, from the call to its recorded reply."""

    def before_model(self, ctx: TurnContext, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        scope = _scope.get()
        if scope is None or not scope.claimed:
            return messages
        scope.model_started = time.monotonic()
        t = telemetry.tracer()
        if t is not None and scope.span is not None:
            from opentelemetry import trace

            attrs: dict[str, Any] = {"tooloop.run_id": ctx.run_id, "tooloop.iteration": ctx.iteration,
                                     "gen_ai.request.model": ctx.spec.model,
                                     "tooloop.messages": len(messages)}  # fmt: skip
            if get_settings().trace_content and messages:
                attrs["tooloop.input"] = telemetry.scrub(str(messages[-1].get("content") or ""))
            scope.model_span = t.start_span("tooloop.model_call", trace.set_span_in_context(scope.span),
                                            attributes=attrs)  # fmt: skip
        else:
            scope.model_span = True  # timing only
        return messages

    def after_turn(self, ctx: TurnContext, decision: Finish | RunTools, tokens: int) -> None:
        scope = _scope.get()
        if scope is None or scope.model_span is None:
            return
        output = None
        if get_settings().trace_content:
            output = decision.content if isinstance(decision, Finish) else json.dumps(
                [{"name": c.name, "arguments": c.arguments} for c in decision.calls])
        _end_model(scope, tokens=tokens, error=None, output=output)
        if scope.span is not None:
            calls = len(decision.calls) if isinstance(decision, RunTools) else 0
            scope.span.set_attributes({"tooloop.tokens": tokens, "tooloop.tool_calls": calls})


def _end_model(scope: Scope, tokens: int | None, error: str | None, output: str | None = None) -> None:
    seconds = time.monotonic() - scope.model_started
    m = metrics.get()
    if m is not None:
        m.model_seconds.labels(scope.model, "error" if error else "ok").observe(seconds)
        if tokens:
            m.tokens.labels(scope.model).inc(tokens)
    span, scope.model_span = scope.model_span, None
    if span is True or span is None:
        return
    if tokens is not None:
        span.set_attribute("gen_ai.usage.total_tokens", tokens)
    if output is not None:
        span.set_attribute("tooloop.output", telemetry.scrub(output))
    if error:
        _fail(span, error)
    span.end()


# -- helpers ------------------------------------------------------------------------------------
def _start_span(scope: Scope, name: str, attributes: dict[str, Any] | None = None,
                current: bool = False) -> None:  # fmt: skip
    t = telemetry.tracer()
    if t is None:
        return
    parent = telemetry.parent_context(scope.prefix, scope.run_id, scope.headers)
    attrs = {"tooloop.run_id": scope.run_id, **(attributes or {})}
    if scope.iteration is not None:
        attrs["tooloop.iteration"] = scope.iteration
    scope.span = t.start_span(name, parent, attributes=attrs)
    if current:
        from opentelemetry import context, trace

        scope.span_token = context.attach(trace.set_span_in_context(scope.span))


def _fail(span: Any, error_type: str) -> None:
    from opentelemetry.trace import Status as SpanStatus
    from opentelemetry.trace import StatusCode

    span.set_attribute("error.type", error_type)
    span.set_status(SpanStatus(StatusCode.ERROR, error_type))


def _error_type(error: str) -> str:
    """``"Timeout: ..."`` -> ``Timeout``: the leading name of a tool call's error."""
    head = error.split(":", 1)[0].strip()
    return head if head.isidentifier() else "ToolError"


# -- processes ------------------------------------------------------------------------------------
@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _log_format(logger: logging.Logger | None = None, **_: Any) -> None:
    if get_settings().log_format == "json":
        logs.use_json(logger)


@signals.worker_process_shutdown.connect
@signals.worker_shutdown.connect
def _flush(**_: Any) -> None:
    """Pool children exit without atexit handlers: send what their exporter still holds."""
    try:
        telemetry.flush()
    except Exception:
        log.warning("telemetry: flushing spans failed", exc_info=True)
