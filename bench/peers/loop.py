"""The agent every system runs, and the model script it runs against.

The scripted model (orchestrator/scripted_model.py) answers by the number of assistant
messages already in the conversation, so every system gets the same replies, and a
turn redone after a kill gets the same reply again.

``add`` records each execution as a line ``a+b`` in ``effects.txt`` of its folder: a
tool call executed twice after a kill -9 shows as a line written twice. ``add(PAUSE_A, b)``
sleeps ``PAUSE_S`` after writing its line: the kill test kills the system then.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

PAUSE_A, PAUSE_S = 1000, 4.0
SYSTEM = "You add numbers with the add tool."
USER = "Add a few numbers."
SCHEMA = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]  # fmt: skip


def steps(tool_turns: int, kill_at: int | None = None) -> list[dict]:
    """The model's script: ``tool_turns`` calls of add, then an answer. With ``kill_at``, the
    calls are add(i, 0) (each a distinct line) and call ``kill_at`` pauses (the kill point)."""
    out = []
    for i in range(1, tool_turns + 1):
        a, b = (2, 3) if kill_at is None else ((PAUSE_A, i) if i == kill_at else (i, 0))
        out.append({"tool_calls": [{"name": "add", "arguments": {"a": a, "b": b}}]})
    return [*out, {"content": "done"}]


def add_recorded(a: int, b: int, folder: str) -> int:
    with open(os.path.join(folder, "effects.txt"), "a") as f:
        f.write(f"{a}+{b}\n")
    if a == PAUSE_A:
        time.sleep(PAUSE_S)
    return a + b


def repeated(folder: str, script: list[dict]) -> int:
    """Executions beyond the first of the calls of ``script`` (each has its own arguments)."""
    lines = executed(folder)
    arguments = [c["arguments"] for step in script for c in step.get("tool_calls", [])]
    calls = {f"{a['a']}+{a['b']}" for a in arguments}
    return sum(max(0, lines.count(call) - 1) for call in calls)


def executed(folder: str) -> list[str]:
    path = os.path.join(folder, "effects.txt")
    return open(path).read().splitlines() if os.path.exists(path) else []


def litellm_message(reply: Any) -> dict:
    """An assistant message as a plain dict (what the next request sends back)."""
    m = reply.choices[0].message
    calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
              "arguments": c.function.arguments}} for c in (m.tool_calls or [])]  # fmt: skip
    return {"role": "assistant", "content": m.content, **({"tool_calls": calls} if calls else {})}


def run_loop(call_model: Callable[[list[dict]], dict], call_tool: Callable[[str], str],
             max_turns: int = 50) -> str:  # fmt: skip
    """The plain tool-calling loop: ask the model, run each call it asks for, until it answers."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    for _ in range(max_turns):
        message = call_model(messages)
        messages.append(message)
        if not message.get("tool_calls"):
            return message["content"]
        for call in message["tool_calls"]:
            output = call_tool(call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
    raise RuntimeError("no answer")


def tool_output(arguments: str, folder: str) -> str:
    return json.dumps(add_recorded(**json.loads(arguments), folder=folder))
