"""The turn task: claim the turn, run the hooks, call the model once, decide, act.

One task per loop turn. The claim fences duplicates and stale deliveries; the
reply is recorded with its token count in one atomic step, so a turn that runs
again after its reply was recorded neither calls the model nor bills twice.
"""

from __future__ import annotations

import time
from typing import Any

from celery.utils.log import get_task_logger
from pydantic import ValidationError

from orchestrator.keys import call_key
from orchestrator.models import Exit, RunSpec
from orchestrator.store import Finish, RunStore, TurnClaim
from worker import llm
from worker.app import TURN_TASK, app, enqueue_call, get_store
from worker.maintenance import INFLIGHT
from worker.middleware import Chain, IterationCap, Middleware, TokenBudget, TurnContext
from worker.registry import REGISTRY
from worker.steps import RunTools, ToolRequest, decide
from worker.supervision import Supervision

log = get_task_logger(__name__)

MIDDLEWARE: list[Middleware] = [IterationCap(), TokenBudget(), Supervision()]
CATALOG_CACHE_S = 5.0


@app.task(name=TURN_TASK)
def turn(run_id: str, iteration: int) -> None:
    run_turn(get_store(), run_id, iteration)


def run_turn(store: RunStore, run_id: str, iteration: int) -> None:
    try:
        claim = store.claim_turn(run_id, iteration)
    except ValidationError as exc:  # a spec that no longer parses would be retried forever
        unreadable = Finish(Exit.error, error=f"stored spec does not parse: {exc}",
                            error_type="SpecUnreadable")  # fmt: skip
        store.finish(run_id, unreadable)
        return
    if isinstance(claim, str):  # ended, paused, stale, busy: nothing to do here
        log.debug("turn %s/%d skipped: %s", run_id, iteration, claim)
        return
    with INFLIGHT.hold(store, run_id, "turn"):
        Turn(store, run_id, iteration, claim).run()


class Turn:
    def __init__(self, store: RunStore, run_id: str, iteration: int, claim: TurnClaim) -> None:
        self.store, self.spec = store, claim.spec
        self.ctx = TurnContext(store, run_id, iteration, claim.spec, claim.tokens_used,
                               claim.messages)  # fmt: skip
        self.chain = Chain(MIDDLEWARE)

    def run(self) -> None:
        end = self.chain.before_turn(self.ctx)
        if end is not None:
            self.store.finish(self.ctx.run_id, end)
            return
        messages = self.chain.before_model(self.ctx, self.ctx.messages)
        try:
            reply = llm.complete(self.spec.model, messages, tool_schemas(self.store, self.spec),
                                 self.spec.model_params)  # fmt: skip
        except llm.ModelError as exc:
            error = Finish(Exit.error, error=str(exc), error_type=exc.error_type)
            self.store.finish(self.ctx.run_id, error, iterations=self.ctx.iteration)
            return
        self.act(decide(reply.message, self.spec, self.ctx.iteration), reply)

    def act(self, decision: Finish | RunTools, reply: llm.Reply) -> None:
        """Record the reply (with its tokens, once), then dispatch the tool calls.

        ``after_turn`` hooks run between the two, so a supervisor steer or pause is
        in place before any tool call of this turn can finish and start the next turn.
        """
        run_id, iteration = self.ctx.run_id, self.ctx.iteration
        if isinstance(decision, Finish):
            verdict = self.store.record_finish(run_id, iteration, reply.message, reply.tokens,
                                               decision)  # fmt: skip
            if verdict == "finished":
                self.chain.after_turn(self.ctx, decision, reply.tokens)
            return
        payloads = [self.payload(i, call) for i, call in enumerate(decision.calls)]
        verdict = self.store.record_tool_calls(run_id, iteration, reply.message, reply.tokens,
                                               payloads)  # fmt: skip
        if verdict != "dispatch":  # aborted meanwhile, or a duplicate lost the race
            log.info("turn %s/%d reply discarded: %s", run_id, iteration, verdict)
            return
        self.chain.after_turn(self.ctx, decision, reply.tokens)
        for payload in payloads:
            enqueue_call(payload)

    def payload(self, index: int, call: ToolRequest) -> dict[str, Any]:
        """Everything a tool worker needs, so it never reads the spec."""
        spec, iteration = self.spec, self.ctx.iteration
        return {
            "run_id": self.ctx.run_id,
            "iteration": iteration,
            "index": index,
            "key": call_key(iteration, index),
            "call_id": call.call_id,
            "tool": call.name,
            "arguments": call.arguments,
            "allowed": call.name in spec.tools,
            "allowed_tools": spec.tools,
            "timeout_s": spec.tool_timeout_s,
            "sandbox_root": spec.context.sandbox_root,
            "bindings": spec.context.resource_bindings,
            "policy": spec.sandbox.model_dump(),
            "idempotency_key": f"{self.ctx.run_id}:{call_key(iteration, index)}",
        }


_catalog: tuple[float, dict[str, dict[str, Any]]] = (0.0, {})


def tool_schemas(store: RunStore, spec: RunSpec) -> list[dict[str, Any]] | None:
    """OpenAI-format schemas of the spec's tools, from this process or the live catalog."""
    global _catalog
    if not spec.tools:
        return None
    missing = [name for name in spec.tools if name not in REGISTRY]
    if missing and time.monotonic() - _catalog[0] > CATALOG_CACHE_S:
        _catalog = (time.monotonic(), store.catalog())
    schemas = []
    for name in spec.tools:
        if name in REGISTRY:
            schemas.append(REGISTRY[name].definition.to_openai())
        elif name in _catalog[1]:
            schemas.append({"type": "function", "function": _catalog[1][name]})
    return schemas or None
