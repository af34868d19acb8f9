"""``tooloop record RUN -o FILE``: an ended run's cassette, from what the run keeps.

The turns come from the run's journal (orchestrator/journal.py): each reply as received,
its request's digest, the steers and compactions of the turn. A turn whose journal entry
is missing (its worker died between the reply and the entry: the reply was kept, not the
entry) falls back to the reply as the history stores it, with no request to compare. The
calls come from their records, with the tool message the model read (from the history,
compactions put back) and the approval decided on them.
"""

from __future__ import annotations

import importlib.metadata
import json
from typing import TYPE_CHECKING, Any

from orchestrator import journal
from orchestrator.fork import ForkError, _iteration_events, _last_reply, read_parent
from orchestrator.keys import parse_call_key
from orchestrator.models import Status
from orchestrator.replay.cassette import FORMAT, Cassette, clean_spec, drop_sealed

if TYPE_CHECKING:
    from orchestrator.fork import Parent
    from orchestrator.store import RunStore


class RecordError(ValueError):
    """A run that cannot be recorded; ``kind``: ``not_found`` or ``running``."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def version() -> str:
    try:
        return importlib.metadata.version("tooloop")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def record(store: RunStore, run_id: str, tenant: str | None = None) -> Cassette:
    """The cassette of an ended run (``RecordError`` for a running or missing one)."""
    try:
        run = read_parent(store, run_id, tenant)
    except ForkError as exc:
        raise RecordError(str(exc), "not_found") from None
    status = run.state.get("status", "")
    if status not in (Status.completed, Status.failed, Status.aborted):
        raise RecordError(f"run {run_id} is {status}: only an ended run can be recorded", "running")
    result = store.result(run_id)
    assert result is not None
    last_reply = _last_reply(store, run)
    forked = json.loads(run.state["forked_from"]) if run.state.get("forked_from") else None
    first = int(forked["iteration"]) if forked else 1
    full = journal.undo(run.messages, run.journal.compactions)
    header: dict[str, Any] = {
        "type": "header", "format": FORMAT, "tooloop": version(), "run_id": run_id,
        "spec": clean_spec(json.loads(run.state["spec"])), "tools": _tools(store, run),
        "start": _start(run, first, last_reply) if forked else None, "forked_from": forked,
    }  # fmt: skip
    cassette = Cassette(header)
    replies = _replies(full, first, last_reply)
    spent = _iteration_events(store, run_id)
    for n in range(first, run.iteration + 1):
        cassette.turns[n] = _turn(run, n, full, replies.get(n), spent)
    approvals = {_s(k): json.loads(v) for k, v in store.redis.hgetall(store.keys.approvals(run_id)).items()
                 if not _s(k).startswith("id:")}  # fmt: skip
    for key, raw in run.calls.items():
        n, index = parse_call_key(key)
        if n < first:
            continue  # a fork's calls before it: its parent's
        cassette.calls[key] = {"type": "call", "iteration": n, "index": index, "record": json.loads(raw),
                               "message": _tool_message(full, replies.get(n), index),
                               "approval": _approval(approvals.get(key))}  # fmt: skip
    cassette.end = {"type": "end", "result": result.model_dump(mode="json")}
    return cassette


def _start(run: Parent, first: int, last_reply: int) -> dict[str, Any]:
    """A fork's history and spending when its first turn began: where its replay starts."""
    entry = run.journal.turns.get(first) or {}
    messages = journal.history_at(run.messages, run.journal, first, last_reply)
    tokens = int(entry.get("tokens_before", run.state.get("tokens_used") or 0))
    cost = float(entry.get("cost_before", run.state.get("cost_usd") or 0.0))
    return {"iteration": first, "messages": drop_sealed(messages), "tokens_used": tokens, "cost_usd": cost}


def _tools(store: RunStore, run: Parent) -> list[dict[str, Any]]:
    """The tool schemas the model was first offered (the journal's), else the live catalog's."""
    first = min(run.journal.turns, default=None)
    digest = run.journal.turns[first].get("tools") if first is not None else None
    if digest in run.journal.tool_sets:
        return run.journal.tool_sets[digest]
    spec = json.loads(run.state["spec"])
    catalog = store.catalog()
    fields = ("name", "description", "parameters")
    return [{"type": "function", "function": {k: catalog[n][k] for k in fields}}
            for n in spec.get("tools") or [] if n in catalog]  # fmt: skip


def _replies(history: list[dict[str, Any]], first: int, last_reply: int) -> dict[int, int]:
    """Turn -> the index of its reply in the whole history (each turn keeps one reply; the
    last is turn ``last_reply``'s)."""
    indexes = [i for i, m in enumerate(history) if m.get("role") == "assistant"]
    return {n: indexes[n - last_reply - 1] for n in range(first, last_reply + 1)
            if last_reply - n < len(indexes)}  # fmt: skip


def _turn(run: Parent, n: int, history: list[dict[str, Any]], reply_at: int | None,
          spent: dict[int, tuple[int, float]]) -> dict[str, Any]:  # fmt: skip
    entry = run.journal.turns.get(n)
    line: dict[str, Any] = {"type": "turn", "iteration": n, "request": None, "reply": None, "steers": [],
                            "compactions": [], "tokens_before": None, "error": None}  # fmt: skip
    if entry is not None:
        line.update({k: entry.get(k) for k in ("request", "reply", "steers", "compactions", "tokens_before")})
        line["steers"] = line["steers"] or []
        line["compactions"] = line["compactions"] or []
    elif reply_at is not None:  # the reply as the history keeps it, its tokens from the events
        stored = {k: v for k, v in history[reply_at].items() if k in ("content", "tool_calls")}
        tokens = spent.get(n, (0, 0.0))[0] - spent.get(n - 1, (0, 0.0))[0] if n in spent else 0
        line["reply"] = {**drop_sealed(stored), "usage": {"total_tokens": max(0, tokens)}}
    if line["reply"] is None and n == run.iteration and run.state.get("exit") == "error":
        line["error"] = {"type": run.state.get("error_type") or "", "message": run.state.get("error") or ""}
    return line


def _tool_message(history: list[dict[str, Any]], reply_at: int | None, index: int) -> str | None:
    """What the model read of call ``index``: the index-th tool message after its reply."""
    if reply_at is None:
        return None
    for seen, message in enumerate(history[reply_at + 1 :]):
        if message.get("role") != "tool":
            break
        if seen == index:
            content = message.get("content")
            return content if isinstance(content, str) else json.dumps(content)
    return None


def _approval(approval: dict[str, Any] | None) -> dict[str, Any] | None:
    if not approval or approval.get("state") not in ("approved", "denied"):
        return None
    return {"decision": approval["state"], "reason": approval.get("reason") or "", "by": approval.get("by")}


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
