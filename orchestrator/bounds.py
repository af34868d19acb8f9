"""Size limits of everything a run keeps or accepts, and the pure functions that apply them.

A tool may return megabytes and a model may write them: what reaches the model,
what Redis keeps and what the API accepts are bounded here, each with a marker
that says how much was cut.
"""

from __future__ import annotations

import json
from typing import Any

RECORD_MAX_BYTES = 16 * 1024  # one tool-call record in Redis (inputs + output + error)
RECORD_INPUTS_MAX_BYTES = 4 * 1024  # of which the inputs
ERROR_MAX_CHARS = 2000  # a failed call's error, in its record and in what the model sees
REPLY_MAX_CHARS = 100_000  # a model reply (text plus tool-call arguments); beyond it, the run errors
STEER_MAX_CHARS = 10_000  # one steer text
REASON_MAX_CHARS = 1_000  # an abort reason
API_BODY_MAX_BYTES = 1 << 20  # any request body of the operator API
SPEC_MAX_BYTES = API_BODY_MAX_BYTES  # a spec as JSON, whichever entrance it comes through
MIN_STRING = 64  # strings this short are never cut (a marker would be longer)


class TooLong(ValueError):
    """A person's text over its bound: refused, never cut, so they know what was kept."""


def refuse_long(what: str, text: str, limit: int) -> None:
    """``TooLong`` when ``text`` has more than ``limit`` characters. The store calls it
    before writing, so the CLI, ``RunHandle`` and the API all meet the same bound."""
    if len(text) > limit:
        raise TooLong(f"{what} has {len(text):,} characters; the limit is {limit:,}")


def spec_size_error(spec_json: str) -> str | None:
    """Why a spec (its JSON) is refused for its size, or None: the API refuses a larger
    body, so the CLI and ``Client.submit`` refuse the same spec."""
    size = len(spec_json.encode())
    if size <= SPEC_MAX_BYTES:
        return None
    return f"spec: {size:,} bytes as JSON; the limit is {SPEC_MAX_BYTES:,}"


def cut_text(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters: the head two thirds, a marker, the tail third."""
    if len(text) <= limit:
        return text
    marker = _marker(len(text) - limit, len(text))
    keep = max(0, limit - len(marker))
    head = keep * 2 // 3
    tail = keep - head
    cut = len(text) - head - tail
    marker = _marker(cut, len(text))  # the real count (it shifts by the marker's own length)
    return text[:head] + marker + (text[-tail:] if tail else "")


def _marker(cut: int, total: int) -> str:
    return f"\n[... {cut:,} of {total:,} characters cut ...]\n"


def json_size(value: Any) -> int:
    return len(json.dumps(value))


def bound_value(value: Any, max_bytes: int) -> Any:
    """A JSON value whose encoding fits ``max_bytes``, keeping its type: long strings are
    cut (head and tail), long lists and objects lose their middle items, with markers."""
    if json_size(value) <= max_bytes:
        return value
    if isinstance(value, str):
        return _fit_string(value, max_bytes)
    if not isinstance(value, list | dict):
        return value  # numbers, booleans, null: already small
    smallest = _shrink(value, MIN_STRING)
    if json_size(smallest) > max_bytes:  # too many items, whatever the strings: drop some
        return _drop_items(smallest, max_bytes)
    low, high, best = MIN_STRING + 1, max_bytes, smallest
    while low <= high:  # the largest per-string limit that makes the whole value fit
        mid = (low + high) // 2
        candidate = _shrink(value, mid)
        if json_size(candidate) <= max_bytes:
            best, low = candidate, mid + 1
        else:
            high = mid - 1
    return best


def _fit_string(text: str, max_bytes: int) -> str:
    """Cut until the JSON encoding (escapes included) fits."""
    limit = max(0, max_bytes - 2)
    out = cut_text(text, limit)
    while json_size(out) > max_bytes and limit > 0:
        limit = max(0, limit - (json_size(out) - max_bytes) - 8)
        out = cut_text(text, limit)
    return out


def _shrink(value: Any, string_limit: int) -> Any:
    if isinstance(value, str):
        return cut_text(value, string_limit) if len(value) > string_limit else value
    if isinstance(value, list):
        return [_shrink(v, string_limit) for v in value]
    if isinstance(value, dict):
        return {k: _shrink(v, string_limit) for k, v in value.items()}
    return value


def _drop_items(value: Any, max_bytes: int) -> Any:
    """Too many small items. A list keeps its first items that fit; an object cuts down its
    largest members first, so small ones (a count, a status) stay. Markers say what went."""
    if isinstance(value, dict):
        return _drop_members(value, max_bytes)
    if not isinstance(value, list):
        return value
    reserve = json_size([_dropped(10**9)])
    used, kept = 2, []
    for item in value:
        room = max_bytes - used - reserve - 2
        size = json_size(item)
        if size <= room:
            kept.append(item)
            used += size + 2
            continue
        if isinstance(item, list | dict) and room > MIN_STRING:
            kept.append(_drop_items(item, room))
        break
    return kept + ([_dropped(len(value) - len(kept))] if len(kept) < len(value) else [])


def _drop_members(value: dict[Any, Any], max_bytes: int) -> dict[Any, Any]:
    out, sizes = dict(value), {k: json_size(v) for k, v in value.items()}
    reserve = json_size({"...": _dropped(10**9)})
    total, dropped = json_size(out), 0
    order = sorted(enumerate(sizes), key=lambda ik: (sizes[ik[1]], ik[0]), reverse=True)
    for _, key in order:  # largest first; among equals, the last first
        if total + (reserve if dropped else 0) <= max_bytes:
            break
        room = max_bytes - reserve - (total - sizes[key])
        item = out[key]
        if room > MIN_STRING and isinstance(item, list | dict | str):
            out[key] = _fit_string(item, room) if isinstance(item, str) else _drop_items(item, room)
            total += json_size(out[key]) - sizes[key]
        else:
            del out[key]
            total -= sizes[key] + len(json.dumps(key)) + 4  # the member, ", " and ": "
            dropped += 1
    return {**out, "...": _dropped(dropped)} if dropped else out


def _dropped(count: int) -> str:
    return f"[... {count:,} more items cut ...]"
