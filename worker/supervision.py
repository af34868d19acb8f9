"""The supervisor in the workers: a middleware after each turn, and the judge task.

``Supervision.after_turn`` runs once a turn's reply is recorded and its tool
calls are dispatched. It evaluates the spec's rules and loop detectors (pure
logic in ``orchestrator/supervisor.py``), marks each firing once per run in the
run's supervisor hash (``store.mark_once``, which also emits the ``supervisor``
event) and acts: steer (drained at the next turn boundary), pause (parks calls
not started yet) or abort (ends the run at once).

Every ``every_n_iterations`` turns it also sends ``tooloop.judge`` to the turns
queue, so the turn thread never waits on the judge model: at most one judge is
in flight per run (a flag in the supervisor hash holding its deadline, so a lost
judge blocks nobody past it), and the judge sees only loop metadata.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from orchestrator import control
from orchestrator import supervisor as sv
from orchestrator.models import JudgeSpec, Status
from orchestrator.store import Finish, RunStore
from worker import llm
from worker.app import app, get_store
from worker.middleware import Middleware, TurnContext
from worker.steps import RunTools

log = logging.getLogger(__name__)

JUDGE_TASK = "tooloop.judge"
JUDGE_FLAG = "judge_inflight"  # supervisor hash field: "<deadline ms>:<iteration>"
QUEUE_GRACE_S = 30.0  # a judge not started this long after its turn is dropped
BY = "supervisor"

T = TypeVar("T")


class Supervision(Middleware):
    """Rules, loop detectors and the judge, for runs whose spec has a ``supervisor`` block."""

    def after_turn(self, ctx: TurnContext, decision: Finish | RunTools, tokens: int) -> None:
        sup = ctx.spec.supervisor
        if sup is None or not isinstance(decision, RunTools):
            return  # no supervisor, or the run just ended: nothing left to steer
        view = loop_view(ctx, decision, tokens)
        for firing in sv.evaluate(sup, view):
            fire(ctx.store, ctx.run_id, view.iteration, firing)
        if sup.judge is not None and view.iteration % sup.judge.every_n_iterations == 0:
            request_judge(ctx.store, ctx.run_id, sup.judge, view)


def loop_view(ctx: TurnContext, decision: RunTools, tokens: int) -> sv.LoopView:
    current = [(call.name, call.arguments) for call in decision.calls]
    return sv.LoopView(
        iteration=ctx.iteration,
        tokens_used=ctx.tokens_used + tokens,
        token_budget=ctx.spec.token_budget,
        max_iterations=ctx.spec.max_iterations,
        calls=sv.calls_from_messages(ctx.messages, current),
    )


def fire(store: RunStore, run_id: str, iteration: int, firing: sv.Firing) -> None:
    """Mark the firing (first time only, with its event), then act on it."""
    event = ("rule", firing.rule, "action", firing.action, "iteration", iteration)
    if not store.mark_once(run_id, firing.key, *event):
        return
    log.info("run %s: supervisor %s fired at turn %d: %s", run_id, firing.rule, iteration,
             firing.action)  # fmt: skip
    act(store, run_id, firing.action, firing.message, sv.abort_reason(firing))


def act(store: RunStore, run_id: str, action: str, text: str, reason: str) -> str:
    if action == "steer":
        return store.steer(run_id, text, by=BY, source="supervisor")
    if action == "pause":
        return control.pause(store, run_id, by=BY)
    if action == "abort":
        return control.abort(store, run_id, by=BY, reason=reason)
    return "ignored"


# -- the judge -----------------------------------------------------------------------
def request_judge(store: RunStore, run_id: str, judge: JudgeSpec, view: sv.LoopView) -> None:
    """Send the judge for this turn, unless one is still in flight for the run."""
    token = claim_judge(store, run_id, view.iteration, judge.timeout_s + QUEUE_GRACE_S)
    if token is None:
        log.debug("run %s: judge still in flight; turn %d not judged", run_id, view.iteration)
        return
    app.send_task(
        JUDGE_TASK,
        args=(run_id, view.iteration, sv.judge_brief(view), token),
        queue=store.keys.turn_queue,
        task_id=f"judge-{run_id}-{view.iteration}",
        ignore_result=True,
        expires=QUEUE_GRACE_S,
    )


def claim_judge(store: RunStore, run_id: str, iteration: int, ttl_s: float) -> str | None:
    """Set the in-flight flag if it is free or expired; its value is the owner's token.

    WATCH on the run's state too: a run that ended meanwhile gets no judge (and no
    supervisor hash created after its keys were given their retention TTL).
    """
    sup_key, run_key = store.keys.supervisor(run_id), store.keys.run(run_id)
    for _ in range(3):
        with store.redis.pipeline() as pipe:
            try:
                pipe.watch(sup_key, run_key)
                if _ended(pipe.hget(run_key, "status")):
                    return None
                held = _text(pipe.hget(sup_key, JUDGE_FLAG))
                now = store.time_ms()  # Redis's clock: a skewed host cannot stretch the flag
                if held and int(held.split(":")[0]) > now:
                    return None
                token = f"{now + int(ttl_s * 1000)}:{iteration}"
                pipe.multi()
                pipe.hset(sup_key, JUDGE_FLAG, token)
                pipe.execute()
                return token
            except redis.WatchError:
                continue  # a heartbeat touched the run: look again
    return None


def release_judge(store: RunStore, run_id: str, token: str) -> None:
    """Clear the flag if it is still ours (a late judge must not free a newer one's)."""
    sup_key = store.keys.supervisor(run_id)
    with store.redis.pipeline() as pipe:
        try:
            pipe.watch(sup_key)
            if _text(pipe.hget(sup_key, JUDGE_FLAG)) != token:
                return
            pipe.multi()
            pipe.hdel(sup_key, JUDGE_FLAG)
            pipe.execute()
        except redis.WatchError:
            log.debug("run %s: judge flag changed while releasing it", run_id)


@app.task(name=JUDGE_TASK)
def judge_task(run_id: str, iteration: int, brief: dict[str, Any], token: str) -> None:
    store = get_store()
    try:
        run_judge(store, run_id, iteration, brief)
    finally:
        release_judge(store, run_id, token)


def run_judge(store: RunStore, run_id: str, iteration: int, brief: dict[str, Any]) -> None:
    spec = store.spec(run_id)
    if spec is None or spec.supervisor is None or spec.supervisor.judge is None:
        return
    if not _still_running(store, run_id):
        return
    judge = spec.supervisor.judge
    try:
        reply = ask_judge(judge, brief, spec.tenant)
        store.add_usage(run_id, "judge", reply.tokens, reply.cost_usd)  # counts toward the budgets
        verdict = sv.parse_verdict(reply.message.get("content"))
    except Exception as exc:  # timeout, bad answer, API error, or anything else: the policy decides
        on_error(store, run_id, iteration, judge, exc)
        return
    if verdict.passed:
        record_judgement(store, run_id, iteration, "none", "verdict", "passed")
    elif record_judgement(store, run_id, iteration, "steer", "verdict", "failed"):
        store.steer(run_id, sv.judge_steer_text(verdict), by=f"{BY}:judge", source="judge")


def record_judgement(store: RunStore, run_id: str, iteration: int, action: str, *fields: Any) -> bool:
    """The judgement's event, once per judged turn; False if the run ended or it was recorded."""
    if not _still_running(store, run_id):
        return False
    event = ("rule", "judge", "action", action, "iteration", iteration, *fields)
    return store.mark_once(run_id, f"judge:{iteration}", *event)


def ask_judge(judge: JudgeSpec, brief: dict[str, Any], tenant: str) -> llm.Reply:
    """One judge call, cut at ``timeout_s`` of wall-clock time whatever the provider does."""
    params = {"timeout": judge.timeout_s, **judge.model_params}
    messages = sv.judge_messages(brief)
    return with_deadline(lambda: llm.complete(judge.model, messages, None, params, tenant),
                         judge.timeout_s)  # fmt: skip


def on_error(store: RunStore, run_id: str, iteration: int, judge: JudgeSpec, exc: Exception) -> None:
    """Judge errors fail open unless the spec says ``on_judge_error: pause | abort``."""
    error_type = getattr(exc, "error_type", type(exc).__name__)
    log.warning("run %s: judge of turn %d failed (%s): %s", run_id, iteration, error_type, exc)
    action = judge.on_judge_error
    if record_judgement(store, run_id, iteration, action, "verdict", "error", "error_type", error_type):
        reason = f"supervisor judge failed ({error_type}); on_judge_error is {action}"
        act(store, run_id, action, "", reason)


def with_deadline(fn: Callable[[], T], timeout_s: float) -> T:
    """Run ``fn`` in a helper thread; a ``Timeout`` model error if it has not returned in time.

    The litellm ``timeout`` param should end the call about then, with the same
    ``Timeout`` name whichever fires first; the thread is a daemon, so a provider
    that ignores it cannot hold the worker at shutdown.
    """
    box: dict[str, Any] = {}
    done = threading.Event()

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=call, name="tooloop-judge-call", daemon=True).start()
    if not done.wait(timeout_s):
        raise llm.ModelError("Timeout", f"judge did not answer within {timeout_s:g}s", retryable=True)
    if "error" in box:
        raise box["error"]
    return box["value"]


def _still_running(store: RunStore, run_id: str) -> bool:
    return not _ended(store.redis.hget(store.keys.run(run_id), "status"))


def _ended(status: bytes | str | None) -> bool:
    """A missing run counts as ended: there is nothing left to supervise."""
    text = _text(status)
    return not text or Status(text).ended


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value
