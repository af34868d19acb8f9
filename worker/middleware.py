"""Cross-cutting concerns of a turn, as small hook classes.

Before-hooks run in order, after-hooks in reverse. A ``before_turn`` hook ends
the run by returning a ``Finish``; a hook that raises is logged and skipped,
never fatal to the run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from orchestrator.models import Exit, RunSpec
from orchestrator.store import Finish, RunStore
from worker.steps import RunTools

log = logging.getLogger(__name__)


@dataclass
class TurnContext:
    store: RunStore
    run_id: str
    iteration: int
    spec: RunSpec
    tokens_used: int
    messages: list[dict[str, Any]]
    cost_usd: float = 0.0  # spent so far, all model calls of the run


class Middleware:
    """No-op hooks; subclasses override the ones they need."""

    def before_turn(self, ctx: TurnContext) -> Finish | None:
        return None

    def before_model(self, ctx: TurnContext, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return messages

    def after_turn(self, ctx: TurnContext, decision: Finish | RunTools, tokens: int) -> None:
        return None


class IterationCap(Middleware):
    """A turn past ``max_iterations`` ends the run instead of calling the model."""

    def before_turn(self, ctx: TurnContext) -> Finish | None:
        if ctx.iteration <= ctx.spec.max_iterations:
            return None
        limit = ctx.spec.max_iterations
        return Finish(Exit.max_iterations, error=f"reached max_iterations ({limit})",
                      error_type="MaxIterations")  # fmt: skip


class TokenBudget(Middleware):
    """Checked at the top of every turn, against tokens already spent."""

    def before_turn(self, ctx: TurnContext) -> Finish | None:
        budget = ctx.spec.token_budget
        if budget is None or ctx.tokens_used < budget:
            return None
        return Finish(Exit.budget_exceeded, error=f"token budget {budget} spent "
                      f"({ctx.tokens_used} tokens used)", error_type="BudgetExceeded")  # fmt: skip


class CostBudget(Middleware):
    """``cost_budget_usd``, checked at the top of every turn like the token budget."""

    def before_turn(self, ctx: TurnContext) -> Finish | None:
        budget = ctx.spec.cost_budget_usd
        if budget is None or ctx.cost_usd < budget:
            return None
        return Finish(Exit.budget_exceeded, error=f"cost budget ${budget:g} spent (${ctx.cost_usd:.6f} "
                      "spent)", error_type="CostBudgetExceeded")  # fmt: skip


class Chain:
    """Runs a list of middleware with the ordering and error rules above."""

    def __init__(self, middleware: list[Middleware]) -> None:
        self.middleware = middleware

    def before_turn(self, ctx: TurnContext) -> Finish | None:
        for m in self.middleware:
            end = self._safe(m.before_turn, None, ctx)
            if end is not None:
                return end
        return None

    def before_model(self, ctx: TurnContext, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for m in self.middleware:
            messages = self._safe(m.before_model, messages, ctx, messages)
        return messages

    def after_turn(self, ctx: TurnContext, decision: Finish | RunTools, tokens: int) -> None:
        for m in reversed(self.middleware):
            self._safe(m.after_turn, None, ctx, decision, tokens)

    @staticmethod
    def _safe(hook: Any, fallback: Any, *args: Any) -> Any:
        try:
            return hook(*args)
        except Exception:
            log.exception("middleware hook %s failed; skipped", hook.__qualname__)
            return fallback
