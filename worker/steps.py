"""Pure decisions of the loop: what a model reply means (the first messages: orchestrator/prompt.py).

``decide(reply)`` returns ``Finish`` (the run ends) or ``RunTools`` (dispatch
these calls); the turn task then acts on it. Nothing here touches Redis.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from orchestrator.children import tool_names
from orchestrator.http_tools import declared
from orchestrator.models import Exit, RunSpec
from orchestrator.store import Finish
from worker import textcalls

_FENCE = re.compile(r"^\s*```[\w-]*\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)


@dataclass(frozen=True)
class ToolRequest:
    call_id: str
    name: str
    arguments: str  # raw JSON text, exactly as the model wrote it


@dataclass(frozen=True)
class RunTools:
    calls: list[ToolRequest]
    message: dict[str, Any] | None = None  # the reply to record instead (text calls made native)


@dataclass(frozen=True)
class Correct:
    """The reply looked like a tool call written as text that did not parse: say so."""

    text: str  # the corrective user message


def strip_fences(text: str) -> str:
    match = _FENCE.match(text)
    return match.group(1).strip() if match else text.strip()


def decide(
    message: dict[str, Any], spec: RunSpec, iteration: int, corrections: int = 0
) -> Finish | RunTools | Correct:
    """Native tool calls first; without any, calls written as text; else the final answer."""
    calls = message.get("tool_calls") or []
    if calls:
        return capped(RunTools(
            [
                ToolRequest(
                    call.get("id") or f"call_{iteration}_{index}",
                    call["function"]["name"],
                    call["function"].get("arguments") or "{}",
                )
                for index, call in enumerate(calls)
            ]
        ), spec)  # fmt: skip
    content = message.get("content") or ""
    names = [*spec.tools, *declared(spec), *tool_names(spec)]  # every tool the model was offered
    parsed = textcalls.parse(content, names)
    if parsed.calls:
        return capped(text_calls(parsed, iteration), spec)
    if parsed.attempted and corrections < textcalls.MAX_CORRECTIONS:
        return Correct(textcalls.correction(parsed, names))
    return final_answer(content, spec)


def capped(tools: RunTools, spec: RunSpec) -> RunTools | Finish:
    """A reply asking for more calls than ``max_tool_calls_per_turn`` ends the run on
    ``error``, none of them run: one reply must not fan out into thousands of processes,
    and running only some would act on a plan the model did not make."""
    limit = spec.max_tool_calls_per_turn
    if len(tools.calls) <= limit:
        return tools
    why = (f"the model's reply asks for {len(tools.calls)} tool calls; at most {limit} per turn "
           "(max_tool_calls_per_turn): none was run")  # fmt: skip
    return Finish(Exit.error, error=why, error_type="TooManyToolCalls")


def text_calls(parsed: textcalls.Parsed, iteration: int) -> RunTools:
    """Calls written as text become native calls with synthetic ids: their results go back
    as ordinary ``tool`` messages, and the recorded reply carries them as ``tool_calls``."""
    requests = [ToolRequest(f"text_{iteration}_{i}", c.name, c.arguments) for i, c in enumerate(parsed.calls)]
    message = {
        "role": "assistant",
        "content": parsed.remainder or None,
        "tool_calls": [
            {"id": r.call_id, "type": "function", "function": {"name": r.name, "arguments": r.arguments}}
            for r in requests
        ],
    }
    return RunTools(requests, message=message)


def final_answer(content: str, spec: RunSpec) -> Finish:
    text = strip_fences(textcalls.strip_think(content))
    if spec.outcome is None:
        return Finish(Exit.default, content=text)
    try:
        answer = json.loads(text)
    except json.JSONDecodeError as exc:
        return _bad_outcome(text, f"final answer is not JSON: {exc}")
    if not isinstance(answer, dict) or "outcome" not in answer:
        return _bad_outcome(text, 'final answer lacks "outcome"')
    if answer["outcome"] not in spec.outcome.enum:
        allowed = ", ".join(spec.outcome.enum)
        return _bad_outcome(text, f"outcome {answer['outcome']!r} is not one of: {allowed}")
    return Finish(answer["outcome"], content=text, result=answer.get("result"))


def _bad_outcome(text: str, why: str) -> Finish:
    return Finish(Exit.error, content=text, error=why, error_type="InvalidOutcome")
