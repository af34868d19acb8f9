"""What a run keeps and shows: scrubbed of secrets, bounded in size.

- ``tool_result``: a tool call's record (at most 16 KiB in Redis) and the tool
  message the model sees (at most ``max_tool_output_chars``; a ``str`` output as it
  is, any other value as JSON: ``model_text``), both scrubbed.
- ``stored_reply`` / ``clean_finish``: a model reply and a final answer before
  they are recorded; ``oversized`` refuses a reply too large to keep.
- ``protect_arguments`` / ``open_arguments``: tool-call arguments that hold a
  secret travel sealed (Redis, the broker, Flower) and are opened by the tool task.
- ``model_view``: the history as the model gets it.

By default the model sees the scrubbed text. A spec with ``scrub_model_input:
false`` keeps, next to each scrubbed message, the original sealed with
``TOOLOOP_SECRET_KEY`` (never in clear), and ``model_view`` opens it.
Never imports litellm: the tool task uses this module.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any

from orchestrator.bounds import (
    ERROR_MAX_CHARS,
    RECORD_INPUTS_MAX_BYTES,
    RECORD_MAX_BYTES,
    REPLY_MAX_CHARS,
    bound_value,
    cut_text,
    json_size,
)
from orchestrator.calls import model_call_id
from orchestrator.models import Exit, RunSpec, ToolCallRecord
from orchestrator.scrub import scrub_text, scrub_value
from orchestrator.secrets import SecretError, is_sealed, seal, unseal
from orchestrator.store import Finish

log = logging.getLogger(__name__)

SEALED_FIELD = "tooloop_sealed"  # a stored message's original fields, sealed; never sent on
DEFAULT_MAX_OUTPUT_CHARS = 50_000


# -- tool calls ------------------------------------------------------------------------
def tool_result(payload: dict[str, Any], ok: bool, output: Any, error: str | None, inputs: Any,
                duration_ms: float) -> tuple[ToolCallRecord, str]:  # fmt: skip
    """The call's record and its tool message (stored as JSON), scrubbed and bounded."""
    limit = int(payload.get("max_output_chars") or DEFAULT_MAX_OUTPUT_CHARS)
    error = scrub_text(cut_text(error, ERROR_MAX_CHARS)) if error else None
    clean_output = scrub_value(output) if ok else None
    content = cut_text(model_text(clean_output) if ok else f"Error: {error}", limit)
    message: dict[str, Any] = {"role": "tool", "tool_call_id": model_call_id(payload), "content": content}
    if not payload.get("scrub_model_input", True) and ok:
        original = {"content": cut_text(model_text(output), limit)}
        message = _keep_original(message, original, payload.get("tenant", "default"))
    clean_inputs = bound_value(scrub_value(inputs), RECORD_INPUTS_MAX_BYTES)
    room = RECORD_MAX_BYTES - json_size(clean_inputs) - len(error or "") - 400  # the other fields
    record = ToolCallRecord(
        call_id=payload["call_id"], tool_name=payload["tool"], inputs=clean_inputs,
        output=bound_value(clean_output, room), duration_ms=duration_ms, success=ok,
        error=error, iteration=payload["iteration"],
    )  # fmt: skip
    return record, json.dumps(message)


def model_text(output: Any) -> str:
    """A tool output as the model reads it: a ``str`` as it is (a file's lines stay lines,
    not one JSON-quoted line of ``\\n``), any other value as JSON."""
    return output if isinstance(output, str) else json.dumps(output)


def protect_arguments(arguments: str, tenant: str) -> str:
    """Arguments with a secret in them travel sealed; scrubbed if they cannot be sealed."""
    clean = scrub_text(arguments)
    if clean == arguments:
        return arguments
    try:
        return seal(arguments, tenant)
    except SecretError:
        return clean


def open_arguments(arguments: str, tenant: str) -> str:
    return unseal(arguments, tenant) if is_sealed(arguments) else arguments


# -- model replies ----------------------------------------------------------------------
def reply_chars(message: dict[str, Any]) -> int:
    calls = message.get("tool_calls") or []
    return len(message.get("content") or "") + sum(
        len(c.get("function", {}).get("arguments") or "") for c in calls
    )


def oversized(message: dict[str, Any]) -> Finish | None:
    """A reply too large to keep ends the run on ``error``; only a cut copy is stored."""
    size = reply_chars(message)
    if size <= REPLY_MAX_CHARS:
        return None
    why = f"the model's reply has {size:,} characters, over the limit of {REPLY_MAX_CHARS:,}"
    return Finish(Exit.error, error=f"{why}; it was cut and not acted on", error_type="ReplyTooLarge")


def stored_reply(message: dict[str, Any], spec: RunSpec, limit: int = REPLY_MAX_CHARS) -> dict[str, Any]:
    """The assistant message as Redis keeps it: scrubbed, cut to ``limit`` characters."""
    content = cut_text(message["content"], limit) if message.get("content") else message.get("content")
    clean = {**message, "content": scrub_text(content) if content else content}
    original: dict[str, Any] = {}
    if content != clean["content"]:
        original["content"] = content
    calls = message.get("tool_calls")
    if calls:
        clean["tool_calls"] = [_clean_call(c, limit) for c in calls]
        if any(_has_secret(_args(c), limit) for c in calls):
            original["tool_calls"] = calls
    if original and not spec.scrub_model_input:
        clean = _keep_original(clean, original, spec.tenant)
    return clean


def _args(call: dict[str, Any]) -> str:
    return (call.get("function") or {}).get("arguments") or ""


def _has_secret(text: str, limit: int) -> bool:
    cut = cut_text(text, limit)
    return scrub_text(cut) != cut


def _clean_call(call: dict[str, Any], limit: int) -> dict[str, Any]:
    fn = call.get("function") or {}
    return {**call, "function": {**fn, "arguments": _clean_text(fn.get("arguments"), limit)}}


def _clean_text(text: str | None, limit: int) -> str | None:
    return scrub_text(cut_text(text, limit)) if text else text


def clean_finish(end: Finish) -> Finish:
    """The final answer, its parsed result and any error, scrubbed and bounded."""
    return replace(
        end,
        content=scrub_text(cut_text(end.content or "", REPLY_MAX_CHARS)),
        result=bound_value(scrub_value(end.result), REPLY_MAX_CHARS),
        error=scrub_text(cut_text(end.error or "", ERROR_MAX_CHARS)),
    )


# -- the model's view -----------------------------------------------------------------
def model_view(messages: list[dict[str, Any]], spec: RunSpec) -> list[dict[str, Any]]:
    """Messages as sent to the model: originals opened for ``scrub_model_input: false``."""
    if not any(SEALED_FIELD in m for m in messages):
        return messages
    return [_open(m, spec.scrub_model_input, spec.tenant) for m in messages]


def _open(message: dict[str, Any], scrub: bool, tenant: str) -> dict[str, Any]:
    sealed = message.get(SEALED_FIELD)
    if sealed is None:
        return message
    out = {k: v for k, v in message.items() if k != SEALED_FIELD}
    if not scrub:
        try:
            out.update(json.loads(unseal(sealed, tenant)))
        except SecretError:
            log.warning("a sealed message does not open with this TOOLOOP_SECRET_KEY: scrubbed text sent")
    return out


def given_prompt(text: str, tenant: str) -> dict[str, Any]:
    """A prompt a model wrote for another run (a child agent's call): the user message, its
    secrets masked as in a tool output, the original kept sealed for a run with
    ``scrub_model_input: false``."""
    clean = scrub_text(text)
    message = {"role": "user", "content": clean}
    return message if clean == text else _keep_original(message, {"content": text}, tenant)


def _keep_original(message: dict[str, Any], original: dict[str, Any], tenant: str) -> dict[str, Any]:
    try:
        return {**message, SEALED_FIELD: seal(json.dumps(original), tenant)}
    except SecretError:
        log.warning("scrub_model_input is false but TOOLOOP_SECRET_KEY is not set: the model "
                    "sees scrubbed text")  # fmt: skip
        return message
