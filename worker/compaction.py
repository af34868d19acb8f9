"""Context compaction: older messages summarised into one, so a long run fits its context.

It starts when the history passes a threshold: more than ``MAX_MESSAGES``
non-system messages, or an estimated prompt above the run's context budget
(``context_tokens``; by default three quarters of the model's window when
litellm knows it). A provider's "context window exceeded" forces it once.

The system prompt, the first user message, the operator's steer messages and
the most recent ``KEEP_RECENT`` messages (fewer if they alone would pass the
budget) stay verbatim; the rest becomes one
summary written by the run's model (from a transcript of at most 12,000
characters; the summary at most 2,000). The cut never separates an assistant's
tool calls from their results. If the summary call fails, a cut-down transcript
stands in. The new history replaces the old in Redis in one step (with the
call's tokens and a ``compaction`` event), so a turn that runs again later sees
the compacted history and does not compact, or bill, twice.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from orchestrator.bounds import cut_text
from orchestrator.models import RunSpec
from worker import aio, llm

log = logging.getLogger(__name__)

MAX_MESSAGES = 50  # non-system messages
KEEP_RECENT = 20
SOURCE_MAX_CHARS = 12_000
MESSAGE_MAX_CHARS = 1_500  # one message, in the transcript
SUMMARY_MAX_CHARS = 2_000
WINDOW_SHARE = 0.75  # of the model's window, when the spec sets no context_tokens
SUMMARY_PROMPT = (  # its first words identify compaction requests (scripted_model.SUMMARY_MARKER)
    "You compress the history of an agent's run so it can go on with a shorter context. "
    "Write a summary of at most 300 words: what was asked, what the agent did (tools called, "
    "with the results that still matter: values, names, paths, errors), what it learnt, and what "
    "was left to do. Keep operator guidance. No preamble."
)
SUMMARY_HEADER = "[Summary of the earlier part of this run, {n} messages compacted]\n"


@dataclass(frozen=True)
class Split:
    head: int  # messages[:head] stay: the system prompt and the first user message
    start: int  # messages[start:] stay: the most recent ones, whole tool-call groups
    kept: list[dict[str, Any]]  # system messages (steers) from between them, kept verbatim
    middle: list[dict[str, Any]]  # the rest, to be summarised


@dataclass(frozen=True)
class Compacted:
    messages: list[dict[str, Any]]
    split: Split
    summary: dict[str, Any]
    tokens: int
    cost_usd: float
    fallback: bool  # the summary call failed: a cut-down transcript stands in
    reply: llm.Reply | None = None  # the summary call's reply as received (the run's journal keeps it)


def budget(spec: RunSpec) -> int | None:
    """Estimated prompt tokens past which the history is compacted."""
    if spec.context_tokens:
        return spec.context_tokens
    window = llm.context_window(spec.model)
    return int(window * WINDOW_SHARE) if window else None


def needed(messages: list[dict[str, Any]], spec: RunSpec) -> bool:
    if sum(1 for m in messages if m.get("role") != "system") > MAX_MESSAGES:
        return True
    limit = budget(spec)
    return limit is not None and llm.estimate_tokens(messages) > limit


def keep_for(messages: list[dict[str, Any]], spec: RunSpec) -> int:
    """``KEEP_RECENT``, or fewer when the head, a summary and those messages alone would pass the
    context budget (else every turn would compact again)."""
    limit, keep = budget(spec), KEEP_RECENT
    if limit is None:
        return keep
    head = llm.estimate_tokens(messages[: _head_end(messages)]) + SUMMARY_MAX_CHARS // 4
    while keep > 2 and head + llm.estimate_tokens(messages[-keep:]) > limit:
        keep //= 2
    return keep


def split(messages: list[dict[str, Any]], keep_recent: int = KEEP_RECENT) -> Split | None:
    """Where to cut; None when nothing lies between the head and the recent messages."""
    head = _head_end(messages)
    start = max(head, len(messages) - keep_recent)
    while start > head and messages[start].get("role") == "tool":
        start -= 1  # a tool result's call is earlier: keep the whole group
    between = messages[head:start]
    middle = [m for m in between if m.get("role") != "system"]
    if not middle:
        return None
    return Split(head, start, [m for m in between if m.get("role") == "system"], middle)


def _head_end(messages: list[dict[str, Any]]) -> int:
    """Just past the first user message (the task); system messages before it included."""
    for i, message in enumerate(messages):
        if message.get("role") == "user":
            return i + 1
    return min(1, len(messages))


def transcript(middle: list[dict[str, Any]], limit: int = SOURCE_MAX_CHARS) -> str:
    lines = []
    for message in middle:
        text = str(message.get("content") or "")
        for call in message.get("tool_calls") or []:
            fn = call.get("function") or {}
            text += f"\n-> {fn.get('name')}({fn.get('arguments') or ''})"
        lines.append(f"{message.get('role')}: {cut_text(text.strip(), MESSAGE_MAX_CHARS)}")
    return cut_text("\n".join(lines), limit)


def compact(
    messages: list[dict[str, Any]], spec: RunSpec, keep_recent: int = KEEP_RECENT, gate: Any = None
) -> Compacted | None:
    """``acompact`` on the process's event loop, for sync callers (never from the loop itself)."""
    return aio.run(acompact(messages, spec, keep_recent, gate))


async def acompact(
    messages: list[dict[str, Any]], spec: RunSpec, keep_recent: int = KEEP_RECENT, gate: Any = None
) -> Compacted | None:
    """The compacted history (not stored yet), or None if there is nothing to compact."""
    cut = split(messages, keep_recent)
    if cut is None:
        return None
    source = transcript(cut.middle)
    request = [{"role": "system", "content": SUMMARY_PROMPT}, {"role": "user", "content": source}]
    params = {k: v for k, v in spec.model_params.items() if k != "stream"}
    text, tokens, cost, fallback, reply = source, 0, 0.0, True, None
    try:
        reply = await llm.acomplete(spec.model, request, None, params, spec.tenant, spec.fallbacks, gate=gate)
        if str(reply.message.get("content") or "").strip():
            text, fallback = str(reply.message["content"]), False
        tokens, cost = reply.tokens, reply.cost_usd
    except llm.ModelError as exc:
        log.warning("compaction: the summary call failed (%s); a cut-down transcript stands in",
                    exc.error_type)  # fmt: skip
    header = SUMMARY_HEADER.format(n=len(cut.middle))
    summary = {"role": "user", "content": header + cut_text(text.strip(), SUMMARY_MAX_CHARS)}
    new = messages[: cut.head] + cut.kept + [summary] + messages[cut.start :]
    return Compacted(new, cut, summary, tokens, cost, fallback, reply)


def forced_keep(messages: list[dict[str, Any]]) -> int:
    """How many recent messages to keep when the provider says the context is too long."""
    return max(2, min(KEEP_RECENT, (len(messages) - _head_end(messages)) // 2))


def extras(compacted: Compacted) -> list[str]:
    """The messages the store puts between the head and the kept recent ones (JSON)."""
    return [json.dumps(m) for m in [*compacted.split.kept, compacted.summary]]
