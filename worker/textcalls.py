"""Tool calls a model wrote as text, for replies that carry no native tool calls.

Pure: ``parse(text, tool_names)`` returns the calls found (names and JSON
arguments), whether the reply looked like an attempted call that did not parse,
and the prose left once the markup is removed. Formats are tried in order, and
the first one that yields a call of one of the run's tools wins:

1. the whole reply as JSON: ``{"tool_calls": [...]}``, a list of calls, or one
   ``{"name", "arguments"|"parameters"}`` (arguments possibly JSON-encoded twice);
2. ``<tool_call>``, ``<toolcall>``, ``<tool-call>``, ``<function_call>`` or
   ``<invoke>`` tags around such JSON;
3. ``<invoke name="x"><parameter name="k">v</parameter></invoke>``;
4. fenced ```` ```tool_call ```` or ```` ```json ```` blocks holding a call.

``<think>`` blocks are stripped first: reasoning may mention calls it never makes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

MAX_CORRECTIONS = 2  # corrective messages per run; later unparsable replies are final answers

_THINK = re.compile(r"<(think|thinking)>.*?(</\1>|\Z)", re.S | re.I)
_TAG_NAMES = r"tool_call|toolcall|tool-call|function_call|invoke"
_TAGGED = re.compile(rf"<({_TAG_NAMES})>\s*(.*?)\s*(?:</\1>|\Z)", re.S | re.I)
_INVOKE = re.compile(r"""<invoke\s+name\s*=\s*["']([^"']+)["']\s*>(.*?)(?:</invoke>|\Z)""", re.S | re.I)
_PARAM = re.compile(r"""<parameter\s+name\s*=\s*["']([^"']+)["']\s*>(.*?)</parameter>""", re.S | re.I)
_FENCED = re.compile(r"```(tool_call|tool-call|json)[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)
_WRAPPERS = re.compile(r"</?(function_calls|tool_calls)>|\[TOOL_CALLS\]", re.I)
# Markup that means "I am calling a tool"; seen without a parsed call, the reply gets corrected.
_ATTEMPT = re.compile(rf"<(?:{_TAG_NAMES})\b|```tool[_-]call|\[TOOL_CALLS\]|<function_calls>", re.I)


@dataclass(frozen=True)
class TextCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class Parsed:
    calls: list[TextCall] = field(default_factory=list)
    attempted: bool = False  # looked like a call, none parsed: worth a corrective message
    problem: str = ""  # why an attempt did not parse (for the corrective message)
    remainder: str = ""  # the reply without think blocks and call markup


def strip_think(text: str) -> str:
    return _THINK.sub("", text).strip()


def parse(text: str, tool_names: Collection[str]) -> Parsed:
    """The calls of known tools written in ``text``, in the first format that has any."""
    body = strip_think(text or "")
    if not body or not tool_names:
        return Parsed(remainder=body)
    problems: list[str] = []
    for fmt in _FORMATS:
        calls, markup = fmt(body, tool_names, problems)
        if calls:
            remainder = body
            for span in markup:
                remainder = remainder.replace(span, "")
            return Parsed(calls, remainder=_WRAPPERS.sub("", remainder).strip())
    attempted = bool(problems) or bool(_ATTEMPT.search(body))
    problem = problems[0] if problems else "no tool call could be read from the markup"
    return Parsed(attempted=attempted, problem=problem if attempted else "", remainder=body)


def correction(parsed: Parsed, tool_names: Collection[str]) -> str:
    """The user message that tells the model how to call a tool properly."""
    names = ", ".join(tool_names)
    return (
        f"Your last reply looked like a tool call, but it could not be read ({parsed.problem}). "
        "Call tools through the tool-calling interface, or write each call exactly as "
        '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>. '
        f"Available tools: {names}. If you meant to give your final answer, give it without "
        "any tool-call markup."
    )


# -- the formats: (body, tool names, problems) -> (calls, markup spans to remove) ----------
Found = tuple[list[TextCall], list[str]]
Format = Callable[[str, Collection[str], list[str]], Found]


def _whole_json(body: str, names: Collection[str], problems: list[str]) -> Found:
    stripped = _WRAPPERS.sub("", body).strip()
    if not stripped.startswith(("{", "[")):
        return [], []
    try:
        data = json.loads(stripped)
    except json.JSONDecodeError:
        return [], []  # prose that happens to start with a brace: a final answer
    return _calls_in(data, names, problems), [body]


def _tagged_json(body: str, names: Collection[str], problems: list[str]) -> Found:
    calls, spans = [], []
    for match in _TAGGED.finditer(body):
        try:
            data = json.loads(match.group(2))
        except json.JSONDecodeError as exc:
            problems.append(f"<{match.group(1)}> does not hold valid JSON: {exc}")
            continue
        found = _calls_in(data, names, problems)
        calls += found
        spans += [match.group(0)] if found else []
    return calls, spans


def _invoke_params(body: str, names: Collection[str], problems: list[str]) -> Found:
    calls, spans = [], []
    for match in _INVOKE.finditer(body):
        name = match.group(1).strip()
        args = {key: _param_value(value) for key, value in _PARAM.findall(match.group(2))}
        call = _known(name, args, names, problems)
        if call is not None:
            calls.append(call)
            spans.append(match.group(0))
    return calls, spans


def _fenced(body: str, names: Collection[str], problems: list[str]) -> Found:
    calls, spans = [], []
    for match in _FENCED.finditer(body):
        try:
            data = json.loads(match.group(2))
        except json.JSONDecodeError as exc:
            if match.group(1).lower() != "json":  # a json fence may hold anything
                problems.append(f"the tool_call block is not valid JSON: {exc}")
            continue
        found = _calls_in(data, names, problems)
        calls += found
        spans += [match.group(0)] if found else []
    return calls, spans


_FORMATS: tuple[Format, ...] = (_whole_json, _tagged_json, _invoke_params, _fenced)


# -- shapes of a call --------------------------------------------------------------------
def _calls_in(data: Any, names: Collection[str], problems: list[str]) -> list[TextCall]:
    """Calls in a decoded JSON value: {"tool_calls": [...]}, a list, or one call."""
    if isinstance(data, dict) and isinstance(data.get("tool_calls"), list):
        data = data["tool_calls"]
    items = data if isinstance(data, list) else [data]
    calls = []
    for item in items:
        call = _one_call(item, names, problems)
        if call is not None:
            calls.append(call)
    return calls


def _one_call(item: Any, names: Collection[str], problems: list[str]) -> TextCall | None:
    if not isinstance(item, dict):
        return None
    if isinstance(item.get("function"), dict):  # OpenAI's own shape, written out as text
        item = item["function"]
    name = item.get("name")
    if not isinstance(name, str) or not ({"arguments", "parameters"} & item.keys()):
        return None  # not shaped like a call (e.g. a JSON final answer)
    raw = item.get("arguments", item.get("parameters"))
    return _known(name, raw, names, problems)


def _known(name: str, raw: Any, names: Collection[str], problems: list[str]) -> TextCall | None:
    if name not in names:
        problems.append(f"there is no tool named {name!r}")
        return None
    args = _decode_arguments(raw)
    if args is None:
        problems.append(f"the arguments of {name!r} are not a JSON object")
        return None
    return TextCall(name, json.dumps(args))


def _decode_arguments(raw: Any) -> dict[str, Any] | None:
    """Arguments as an object; a string is decoded (twice at most: double-encoded JSON)."""
    for _ in range(3):
        if raw is None or raw == "":
            return {}
        if isinstance(raw, dict):
            return raw
        if not isinstance(raw, str):
            return None
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            return None
    return None


def _param_value(text: str) -> Any:
    """An <parameter> value: JSON when it reads as JSON (numbers, objects), else the text."""
    value = text.strip()
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value
