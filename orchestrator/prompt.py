"""The messages a run starts with, built where the spec is: the system prompt (steering,
the loop's instruction, steering files, skills, the outcome's format) and the task."""

from __future__ import annotations

import json
from typing import Any

from orchestrator.models import RunSpec

BASE_INSTRUCTION = (
    "You are an agent working in a loop: call the tools you are given when they help, "
    "read their results, and answer when the task is done. A tool result that starts "
    "with 'Error:' means the call failed; you may fix the arguments and try again."
)


def outcome_instruction(enum: list[str]) -> str:
    values = ", ".join(json.dumps(v) for v in enum)
    return (
        "When you are done, your final answer must be exactly one JSON object and "
        'nothing else: {"outcome": <one of ' + values + '>, "result": <your result>}. '
        "No code fences, no text before or after it."
    )


def system_prompt(spec: RunSpec, steering_docs: list[str] = (), skills: list[str] = ()) -> str:
    parts = [spec.steering] if spec.steering else []
    parts.append(BASE_INSTRUCTION)
    parts += [f"Always follow these instructions:\n{doc}" for doc in steering_docs]
    parts += [f"Skill (apply when relevant):\n{doc}" for doc in skills]
    if spec.outcome:
        parts.append(outcome_instruction(spec.outcome.enum))
    return "\n\n".join(parts)


def initial_messages(
    spec: RunSpec, steering_docs: list[str] = (), skills: list[str] = ()
) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": system_prompt(spec, steering_docs, skills)},
        {"role": "user", "content": spec.prompt},
    ]
