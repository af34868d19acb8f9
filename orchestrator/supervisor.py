"""The supervisor's pure logic: rules, loop detectors, the judge's brief and verdict.

No Redis, no litellm: the worker middleware (``worker/supervision.py``) builds a
``LoopView`` after each turn, asks ``evaluate`` which rules hold, marks each
firing once per run in Redis and acts on it (pause, steer, abort).

The view is built from the conversation (the run's messages plus this turn's
tool calls), not from the tool-call records: it holds the raw arguments the
model wrote and the result each call fed back, and costs no Redis read. This
turn's results are not known yet, so detectors that compare results look at
earlier turns only.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.bounds import REASON_MAX_CHARS, cut_text
from orchestrator.models import SupervisorRule, SupervisorSpec

RECENT_TOOLS = 10  # tool names the judge sees, most recent last
REASON_CHARS = 500  # a judge's reason is cut here before it steers the model
ERROR_PREFIX = "Error:"  # a failed call's tool message starts with this (worker/tool_task.py)


# -- what the supervisor sees --------------------------------------------------------
@dataclass(frozen=True)
class Call:
    tool: str
    arguments: str  # canonical JSON (sorted keys), or the raw text if it is not JSON
    result: str | None = None  # the tool message fed back; None while not known

    @property
    def failed(self) -> bool:
        return self.result is not None and self.result.startswith(ERROR_PREFIX)


@dataclass(frozen=True)
class LoopView:
    iteration: int  # the turn that just ran
    tokens_used: int  # including this turn's reply
    token_budget: int | None
    max_iterations: int
    calls: tuple[Call, ...]  # every call so far, in order; this turn's last (no result)


@dataclass(frozen=True)
class Firing:
    key: str  # at-most-once mark in the run's supervisor hash
    rule: str  # tool_repeated | budget_fraction | iteration_reached | loop_repeat | loop_pingpong
    action: str  # pause | steer | abort
    message: str  # steer text; for abort, the reason


def canonical_arguments(raw: str) -> str:
    """The same arguments written with other spacing or key order compare equal."""
    try:
        return json.dumps(json.loads(raw or "{}"), sort_keys=True, separators=(",", ":"))
    except (json.JSONDecodeError, TypeError):
        return raw


def calls_from_messages(
    messages: Iterable[dict[str, Any]], current: Iterable[tuple[str, str]] = ()
) -> tuple[Call, ...]:
    """Calls of past turns with their results, then ``current`` (name, raw arguments)."""
    requested: list[tuple[str, str, str]] = []  # call id, tool, arguments
    results: dict[str, str] = {}
    for message in messages:
        if message.get("role") == "tool":
            results[str(message.get("tool_call_id"))] = str(message.get("content") or "")
        for call in message.get("tool_calls") or []:
            fn = call.get("function") or {}
            requested.append((str(call.get("id")), fn.get("name", ""), fn.get("arguments") or "{}"))
    calls = [Call(tool, canonical_arguments(args), results.get(cid)) for cid, tool, args in requested]
    calls += [Call(tool, canonical_arguments(args)) for tool, args in current]
    return tuple(calls)


# -- rules -----------------------------------------------------------------------------
def evaluate(spec: SupervisorSpec, view: LoopView) -> list[Firing]:
    """Every rule and detector whose condition holds now (marking once is the caller's)."""
    firings = [
        Firing(f"rule:{index}", rule.when, rule.then, _text(rule, view))
        for index, rule in enumerate(spec.rules)
        if _holds(rule, view)
    ]
    if spec.detect_loops:
        firings += detect_loops(view.calls, spec.loop_count, spec.loop_action)
    return firings


def _holds(rule: SupervisorRule, view: LoopView) -> bool:
    if rule.when == "tool_repeated":
        return longest_repeat(view.calls, rule.tool) >= rule.count
    if rule.when == "budget_fraction":
        return view.token_budget is not None and view.tokens_used > rule.gt * view.token_budget
    return rule.gte is not None and view.iteration >= rule.gte


def longest_repeat(calls: Sequence[Call], tool: str | None = None, with_result: bool = False) -> int:
    """Longest run of identical consecutive calls (same tool, same arguments[, same result]).

    With ``tool``, only runs of that tool count; with ``with_result``, only calls
    whose result is known, compared with it.
    """
    if with_result:
        calls = [c for c in calls if c.result is not None]
    best = streak = 0
    for i, call in enumerate(calls):
        if tool is not None and call.tool != tool:
            streak = 0
            continue
        same = i > 0 and _signature(calls[i - 1], with_result) == _signature(call, with_result)
        streak = streak + 1 if same else 1
        best = max(best, streak)
    return best


def longest_pingpong(calls: Sequence[Call]) -> int:
    """Longest stretch of two different calls alternating (A B A B ...), results included."""
    sigs = [_signature(c, True) for c in calls if c.result is not None]
    best = run = min(len(sigs), 1)
    for i in range(1, len(sigs)):
        if sigs[i] == sigs[i - 1]:
            run = 1
        elif i >= 2 and run >= 2 and sigs[i] == sigs[i - 2]:
            run += 1
        else:
            run = 2
        best = max(best, run)
    return best


def detect_loops(calls: Sequence[Call], count: int, action: str) -> list[Firing]:
    """The same call returning the same result ``count`` times in a row, or two
    calls ping-ponging ``count`` round trips, all with known results."""
    found = []
    if longest_repeat(calls, with_result=True) >= count:
        text = (
            f"The same tool call has returned the same result {count} times in a row: "
            "repeating it will not change the outcome. Use what you have, try a "
            "different approach, or give your final answer."
        )
        found.append(Firing("loop:repeat", "loop_repeat", action, text))
    if longest_pingpong(calls) >= 2 * count:
        text = (
            f"You have alternated between the same two tool calls {count} times, with the "
            "same results each time: this is a loop. Use what you have, try a different "
            "approach, or give your final answer."
        )
        found.append(Firing("loop:pingpong", "loop_pingpong", action, text))
    return found


def _signature(call: Call, with_result: bool) -> tuple[str, str, str | None]:
    return call.tool, call.arguments, call.result if with_result else None


def _text(rule: SupervisorRule, view: LoopView) -> str:
    """The rule's message, or a default that says what happened and what to do."""
    if rule.message:
        return rule.message
    if rule.when == "tool_repeated":
        which = f"the tool {rule.tool}" if rule.tool else "the same tool"
        return (
            f"You have called {which} with the same arguments {rule.count} times in a row. "
            "Repeating it will not help: use the results you have, try a different "
            "approach, or give your final answer."
        )
    if rule.when == "budget_fraction":
        return (
            f"You have used more than {rule.gt:.0%} of your token budget "
            f"({view.tokens_used} of {view.token_budget} tokens). Wrap up and give your "
            "final answer soon."
        )
    return (
        f"This was turn {view.iteration} of at most {view.max_iterations}. Wrap up and "
        "give your final answer soon."
    )


def abort_reason(firing: Firing) -> str:
    """An abort's reason names the rule that fired (cut to the bound the store enforces:
    the rule's message may be as long as a steer text)."""
    return cut_text(f"supervisor rule {firing.rule} ({firing.key}) fired: {firing.message}", REASON_MAX_CHARS)


# -- the judge ---------------------------------------------------------------------------
JUDGE_INSTRUCTIONS = (
    "You supervise an autonomous agent that works in a loop of model turns and tool "
    "calls. You see only metadata about its progress: the turn number, tokens spent, "
    "and which tools it called how often (never the task, arguments or results). "
    "Decide whether the loop looks healthy (making progress, not stuck repeating "
    "itself, not burning its budget for nothing). Answer with exactly one JSON object "
    'and nothing else: {"passed": true|false, "reason": "<one short sentence>"}.'
)


class JudgeError(ValueError):
    """The judge's answer is not the JSON verdict it was asked for."""

    error_type = "BadJudgeAnswer"


@dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str


def judge_brief(view: LoopView) -> dict[str, Any]:
    """All the judge may see: loop metadata, never arguments, results or the prompt."""
    by_tool = Counter(call.tool for call in view.calls)
    return {
        "iteration": view.iteration,
        "max_iterations": view.max_iterations,
        "tokens_used": view.tokens_used,
        "token_budget": view.token_budget,
        "tool_calls": len(view.calls),
        "failed_tool_calls": sum(call.failed for call in view.calls),
        "calls_by_tool": dict(by_tool.most_common()),
        "recent_tools": [call.tool for call in view.calls[-RECENT_TOOLS:]],
    }


def judge_messages(brief: dict[str, Any]) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": JUDGE_INSTRUCTIONS},
        {"role": "user", "content": "Loop metadata:\n" + json.dumps(brief, indent=1)},
    ]


def parse_verdict(content: str | None) -> Verdict:
    """``{"passed": bool, "reason": str}``, code fences tolerated; else ``JudgeError``."""
    text = (content or "").strip()
    if text.startswith("```"):
        text = text.strip("`").removeprefix("json").strip()
    try:
        answer = json.loads(text)
    except json.JSONDecodeError as exc:
        raise JudgeError(f"judge answer is not JSON: {exc}") from exc
    if not isinstance(answer, dict) or not isinstance(answer.get("passed"), bool):
        raise JudgeError('judge answer lacks a boolean "passed"')
    reason = answer.get("reason")
    reason = reason.strip() if isinstance(reason, str) and reason.strip() else "no reason given"
    return Verdict(answer["passed"], reason[:REASON_CHARS])


def judge_steer_text(verdict: Verdict) -> str:
    return (f"An automated judge reviewing this run's progress (not your operator) found a "
            f"problem: {verdict.reason}")  # fmt: skip
