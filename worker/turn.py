"""The turn task: claim the turn, run the hooks, call the model once, decide, act.

One task per loop turn. The claim fences duplicates and stale deliveries; the
reply is recorded with its token count in one atomic step, so a turn that runs
again after its reply was recorded neither calls the model nor bills twice.

A turn spends nearly all its time waiting on the model, so it does not hold a
thread for it: the task claims the turn and runs the ``before_turn`` hooks on its
pool thread, then hands the model call and the rest of the turn to the process's
event loop (``worker/aio.py``) and returns. Its message is acked only when that
work is done (``worker/deferred.py``), and its lease is heartbeated until then
(``INFLIGHT``): a process that dies mid-call loses nothing. On the loop, the
Redis scripts and the publishes of the turn's end go to the loop's blocking pool
(``aio.in_thread``): the loop itself only waits on sockets.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

from celery.utils.log import get_task_logger
from pydantic import ValidationError

from orchestrator import fairshare, journal
from orchestrator.bounds import ERROR_MAX_CHARS, REPLY_MAX_CHARS
from orchestrator.children import tool_schemas as agent_schemas
from orchestrator.http_tools import declared
from orchestrator.models import Exit, RunSpec
from orchestrator.store import Dispatch, Finish, Held, RunStore, TurnClaim, new_owner
from worker import aio, children, compaction, deferred, llm, protect
from worker.app import TURN_TASK, app, enqueue_call, enqueue_turn, get_store
from worker.calls import stored_call
from worker.maintenance import INFLIGHT, with_retries
from worker.middleware import Chain, CostBudget, IterationCap, Middleware, TokenBudget, TurnContext
from worker.observe import ModelTelemetry, TurnTelemetry
from worker.ratelimit import MAX_WAIT_IN_PLACE_S, RateLimited, limiter_for
from worker.registry import REGISTRY, function_schema
from worker.steps import Correct, RunTools, ToolRequest, decide
from worker.streaming import TextStream, live_text
from worker.supervision import Supervision

log = get_task_logger(__name__)

# Telemetry wraps the others: first to see the claimed turn, last before the model call.
MIDDLEWARE: list[Middleware] = [
    TurnTelemetry(), IterationCap(), TokenBudget(), CostBudget(), Supervision(), ModelTelemetry(),
]  # fmt: skip
CATALOG_CACHE_S = 5.0
TURN_SLACK_S = 5.0  # hooks, tool schemas and the record, around a model call
TURN_SOFT_LIMIT_S = 3600.0  # a backstop where Celery enforces limits (prefork); see max_call_s


def max_call_s(spec: RunSpec, limited: bool = False) -> float:
    """How long a turn may hold its lease for one model call: its attempts (each cut at
    ``model_params.timeout``), the backoff between them and, with rate limits (``limited``),
    each attempt's wait for capacity in place, for the model and each fallback; plus slack.

    A turn makes several model calls (a compaction's summary, the reply, a second reply
    after the provider refused the history as too long), so the bound is re-armed when
    each one starts (``Turn.arm``), and once more for the record. Past it the heartbeat
    stops, the lease lapses, the sweeper sends the turn again and the attempts cap ends
    it: a model call that never returns cannot hold a run (threads pools ignore Celery's
    time limits, and a thread blocked in I/O cannot be interrupted)."""
    timeout, retries = llm.timeout_and_retries(spec.model_params)
    wait = MAX_WAIT_IN_PLACE_S if limited else 0.0
    per_model = (timeout + wait) * (1 + retries) + llm.BACKOFF_CAP_S * retries
    return per_model * (1 + len(spec.fallbacks or [])) + TURN_SLACK_S


@app.task(name=TURN_TASK, Request=deferred.DeferredAck, soft_time_limit=TURN_SOFT_LIMIT_S,
          time_limit=TURN_SOFT_LIMIT_S + 60)  # fmt: skip
def turn(run_id: str, iteration: int, gen: int = 0) -> None:
    deferred.reset()
    future = start_turn(get_store(), run_id, iteration, gen)
    if future is not None:
        deferred.defer(future)  # the message is acked when the turn is done on the loop


def run_turn(store: RunStore, run_id: str, iteration: int, gen: int = 0) -> None:
    """One whole turn, waiting for its end (for callers outside a worker's turn task)."""
    future = start_turn(store, run_id, iteration, gen)
    if future is not None:
        future.result()


def start_turn(store: RunStore, run_id: str, iteration: int, gen: int = 0) -> Future | None:
    """Claim the turn and run its ``before_turn`` hooks here; the model call and the rest
    go to the event loop: their future, or None when the turn ended here."""
    owner = new_owner()
    try:
        claim = store.claim_turn(run_id, iteration, gen, owner)
    except ValidationError as exc:  # a spec that no longer parses would be retried forever
        store.finish(run_id, Finish.unreadable(exc), fence=(iteration, owner))
        return None
    if isinstance(claim, str):  # ended, paused, stale, busy, gave_up, budget: nothing to do here
        log.debug("turn %s/%d skipped: %s", run_id, iteration, claim)
        if claim in ("gave_up", "budget"):  # the run ended here: a child's parent learns it now
            children.hand_off(store, run_id)
        return None
    held = Held(run_id, "turn", "", owner, iteration)
    INFLIGHT.add(store, held, max_s=max_call_s(claim.spec, limiter_for(store.settings) is not None))
    future = None
    try:
        work = Turn(store, held, claim)
        if work.prepare():
            future = aio.submit(work.finish_on_loop())
    finally:
        if future is None:
            INFLIGHT.release(held)
    if future is None:
        return None
    future.add_done_callback(lambda _: INFLIGHT.release(held))
    return future


class Superseded(Exception):
    """The run ended, or another delivery of this turn moved on: this one stops."""


class BudgetSpent(Exception):
    """A model call made before the turn's reply (a compaction) used up a budget."""

    def __init__(self, end: Finish) -> None:
        super().__init__(end.error)
        self.end = end


class Turn:
    def __init__(self, store: RunStore, held: Held, claim: TurnClaim) -> None:
        self.store, self.spec, self.held = store, claim.spec, held
        self.ctx = TurnContext(store, held.run_id, held.iteration, claim.spec, claim.tokens_used,
                               claim.messages, claim.cost_usd)  # fmt: skip
        self.chain = Chain(MIDDLEWARE)
        self.corrections = claim.corrections
        self.unbilled: llm.Reply | None = None  # a reply not recorded yet: billed on failure
        self.tools: list[dict[str, Any]] | None = None  # the spec's tool schemas (prepare)
        self.notes = journal.TurnNotes.begin(held.run_id, held.iteration, claim.tokens_used, claim.cost_usd,
                                             claim.messages)  # fmt: skip

    def prepare(self) -> bool:
        """On the task's thread: the ``before_turn`` hooks and the tool schemas. False when
        the turn ended here (a hook ended the run, or this raised: one failed attempt)."""
        try:
            end = self.chain.before_turn(self.ctx)
            if end is not None:
                self._finish(end)
                return False
            self.tools = tool_schemas(self.store, self.spec)
            return True
        except Exception as exc:
            self.failed(exc)
            return False

    async def finish_on_loop(self) -> None:
        """On the event loop: the model call, then the record and dispatch (on the loop's
        blocking pool). A turn that raises is one failed attempt, as on a thread."""
        try:
            await self.run()
        except Exception as exc:
            try:
                await aio.in_thread(self.failed, exc)
            except Exception:  # Redis away: nobody reads this future's error; the lease covers the turn
                held = self.held
                log.exception("turn %s/%d: its failure was not recorded", held.run_id, held.iteration)

    def failed(self, exc: Exception) -> None:
        """A failed attempt: its reply (if any) is billed, and the sweeper sends the turn
        again until the attempts cap ends the run on error."""
        log.error("turn %s/%d failed", self.held.run_id, self.held.iteration, exc_info=exc)
        reply = self.unbilled
        verdict = self.store.fail_turn(self.held.run_id, self.held.iteration, self.held.owner,
                                       reply.tokens if reply else 0, f"{type(exc).__name__}: {exc}",
                                       reply.cost_usd if reply else 0.0)  # fmt: skip
        log.warning("turn %s/%d: %s", self.held.run_id, self.held.iteration, verdict)

    async def run(self) -> None:
        try:
            reply = await self.ask()
        except RateLimited as exc:
            await aio.in_thread(self.defer, exc.wait_s)
            return
        except Superseded as exc:
            log.info("turn %s/%d given up: %s", self.ctx.run_id, self.ctx.iteration, exc)
            return
        except BudgetSpent as exc:
            await aio.in_thread(self._finish, exc.end)  # like a budget spent at the top of the turn
            return
        except llm.ModelError as exc:
            log.warning("run %s: turn %d: model call failed (%s): %s", self.ctx.run_id, self.ctx.iteration,
                        exc.error_type, exc)  # fmt: skip  (the log filter masks secrets)
            error = Finish(Exit.error, error=str(exc), error_type=exc.error_type)
            await aio.in_thread(self._finish, protect.clean_finish(error), self.ctx.iteration)
            return
        self.unbilled = reply
        await aio.in_thread(self.decide_and_act, reply)

    def decide_and_act(self, reply: llm.Reply) -> None:
        INFLIGHT.extend(self.held, self.store.settings.lease_s + TURN_SLACK_S)  # the record's retries
        too_large = protect.oversized(reply.message)
        self.act(too_large or decide(reply.message, self.spec, self.ctx.iteration, self.corrections), reply)

    async def ask(self) -> llm.Reply:
        """The model's reply to the history (compacted first when past its threshold); a
        provider's "context window exceeded" gets one trim-and-retry."""
        await self.compact("threshold")
        messages = self.chain.before_model(self.ctx, self.ctx.messages)
        try:
            return await self.call(messages)
        except llm.ModelError as exc:
            if not exc.context_exceeded or not await self.compact("context_window"):
                raise
        return await self.call(self.ctx.messages)

    def arm(self) -> None:
        """Before each model call: the turn's lease is kept for this call's bound, from now
        (``max_call_s``). ``Superseded`` when it is kept no longer (taken over, or ended)."""
        limited = limiter_for(self.store.settings) is not None
        if not INFLIGHT.extend(self.held, max_call_s(self.spec, limited)):
            raise Superseded("the turn's lease is no longer held")

    async def call(self, messages: list[dict[str, Any]]) -> llm.Reply:
        self.arm()
        self.notes.requested(self.spec.model, messages, self.tools)
        return await llm.acomplete(self.spec.model, protect.model_view(messages, self.spec), self.tools,
                                   self.spec.model_params, self.spec.tenant, self.spec.fallbacks,
                                   on_text=self.live_text(),
                                   gate=limiter_for(self.store.settings))  # fmt: skip

    def live_text(self) -> TextStream | None:
        """With ``stream: true``, the reply's text goes to watchers as it arrives."""
        if not self.spec.model_params.get("stream"):
            return None
        return live_text(self.store, self.ctx.run_id, self.ctx.iteration)

    async def compact(self, reason: str) -> bool:
        """Summarise older messages when the history is past its threshold (or the provider
        refused it: ``context_window``); True if the history was compacted.

        Raises ``Superseded`` when the run ended or another delivery of this turn moved on
        meanwhile, and ``BudgetSpent`` when the summary's tokens used up a budget.
        """
        messages, forced = self.ctx.messages, reason == "context_window"
        if not forced and not compaction.needed(messages, self.spec):
            return False
        keep = compaction.forced_keep(messages) if forced else compaction.keep_for(messages, self.spec)
        self.arm()
        done = await compaction.acompact(messages, self.spec, keep, gate=limiter_for(self.store.settings))
        if done is None:
            return False
        verdict = await aio.in_thread(self.store.compact, self.ctx.run_id, self.ctx.iteration, len(messages),
                                      done.split.head, done.split.start, compaction.extras(done), done.tokens,
                                      done.cost_usd, reason, done.fallback, self.held.owner)  # fmt: skip
        log.info("turn %s/%d: history compacted (%s), %d -> %d messages: %s", self.ctx.run_id,
                 self.ctx.iteration, reason, len(messages), len(done.messages), verdict)  # fmt: skip
        if verdict != "ok":
            raise Superseded(verdict)
        self.notes.compacted(reason, done)
        self.ctx.messages = done.messages
        self.ctx.tokens_used += done.tokens
        self.ctx.cost_usd += done.cost_usd
        # the summary's tokens count toward the budgets now, not only from the next turn on
        spent = TokenBudget().before_turn(self.ctx) or CostBudget().before_turn(self.ctx)
        if spent is not None:
            raise BudgetSpent(spent)
        return True

    def _finish(self, end: Finish, iterations: int | None = None) -> None:
        """End the run, only if this turn is still the run's current one (fenced)."""
        fence = (self.held.iteration, self.held.owner)
        if not with_retries(self.store.finish, self.held.run_id, end, iterations, fence,
                            budget_s=self.store.settings.lease_s):  # fmt: skip
            log.info("turn %s/%d: not ended by this turn (ended, or taken over)",
                     self.held.run_id, self.held.iteration)  # fmt: skip
            return
        children.hand_off(self.store, self.held.run_id)

    def act(self, decision: Finish | RunTools | Correct, reply: llm.Reply) -> None:
        """Record the reply (with its tokens, once), then dispatch the tool calls.

        ``after_turn`` hooks run between the two, so a supervisor steer or pause is
        in place before any tool call of this turn can finish and start the next turn.
        Recording is fenced by the turn's owner: a turn taken over records nothing
        (its reply's tokens are still billed, once).
        """
        run_id, iteration, owner = self.held.run_id, self.held.iteration, self.held.owner
        budget = self.store.settings.lease_s  # a Redis blip: retry within the lease
        journal.stage(self.store, owner, self.notes, reply)  # kept only with the reply it records
        if isinstance(decision, Finish):
            decision = protect.clean_finish(decision)
            message = self.stored(reply.message, cut=decision.error_type == "ReplyTooLarge")
            verdict = with_retries(self.store.record_finish, run_id, iteration, owner, message,
                                   reply.tokens, decision, reply.cost_usd, budget_s=budget)  # fmt: skip
            self.unbilled = None
            if verdict == "finished":
                self.chain.after_turn(self.ctx, decision, reply.tokens)
                children.hand_off(self.store, run_id)
            else:
                log.info("turn %s/%d reply discarded: %s", run_id, iteration, verdict)
            return
        if isinstance(decision, Correct):
            verdict, gen = with_retries(self.store.record_correction, run_id, iteration, owner,
                                        self.stored(reply.message), reply.tokens, decision.text,
                                        reply.cost_usd, budget_s=budget)  # fmt: skip
            self.unbilled = None
            if verdict == "continue":
                enqueue_turn(run_id, iteration + 1, gen)
                fairshare.ahead(self.store, self.spec.tenant, Dispatch(run_id, gen, iteration + 1))
            return
        payloads = [self.payload(i, call) for i, call in enumerate(decision.calls)]
        message = self.stored(decision.message or reply.message)
        verdict = with_retries(self.store.record_tool_calls, run_id, iteration, owner, message,
                               reply.tokens, payloads, reply.cost_usd, budget_s=budget)  # fmt: skip
        self.unbilled = None
        if verdict != "dispatch":  # aborted meanwhile, or taken over
            log.info("turn %s/%d reply discarded: %s", run_id, iteration, verdict)
            return
        self.chain.after_turn(self.ctx, decision, reply.tokens)
        for payload in payloads:
            if payload.get("agent"):  # a child agent: its run starts here (worker/children.py)
                children.start_now(self.store, payload)
            else:
                enqueue_call(payload, 1)
                fairshare.ahead(self.store, self.spec.tenant, Dispatch(run_id, 1, payload=payload))

    def defer(self, wait_s: float) -> None:
        """Wait for rate-limit capacity in the queue (a countdown), not in a worker slot."""
        run_id, iteration = self.ctx.run_id, self.ctx.iteration
        verdict, gen = self.store.defer_turn(run_id, iteration, self.held.owner, wait_s)
        log.info("turn %s/%d waits %.1fs for rate-limit capacity: %s", run_id, iteration, wait_s, verdict)
        if verdict == "ok":
            enqueue_turn(run_id, iteration, gen, countdown=wait_s)

    def stored(self, message: dict[str, Any], cut: bool = False) -> dict[str, Any]:
        """The reply as Redis keeps it: scrubbed; a reply refused as too large only in part."""
        return protect.stored_reply(message, self.spec, ERROR_MAX_CHARS if cut else REPLY_MAX_CHARS)

    def payload(self, index: int, call: ToolRequest) -> dict[str, Any]:
        """The call as stored beside its state; the tool task reads it back with the spec."""
        return stored_call(self.spec, self.ctx.run_id, self.ctx.iteration, index, call.call_id, call.name,
                           call.arguments, _catalog[1])  # fmt: skip


_catalog: tuple[float, dict[str, dict[str, Any]]] = (0.0, {})


def tool_schemas(store: RunStore, spec: RunSpec) -> list[dict[str, Any]] | None:
    """OpenAI-format schemas of the spec's tools, from this process or the live catalog."""
    global _catalog
    declared_http = [function_schema(t.definition()) for t in declared(spec).values()]
    declared_http += agent_schemas(spec)  # child agents (orchestrator/children.py)
    if not spec.tools:
        return declared_http or None
    missing = [name for name in spec.tools if name not in REGISTRY]
    if missing and time.monotonic() - _catalog[0] > CATALOG_CACHE_S:
        _catalog = (time.monotonic(), store.catalog())
    schemas = []
    for name in spec.tools:
        if name in REGISTRY:
            schemas.append(REGISTRY[name].definition.to_openai())
        elif name in _catalog[1]:
            schemas.append(function_schema(_catalog[1][name]))
    return schemas + declared_http or None
