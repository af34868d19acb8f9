"""The runs list: one page of a tenant's runs, newest first, filtered and searched.

Paging is by cursor over the tenant's run index (one sorted set per shard, scored by
creation time, ``RunStore.run_ids_before``): a page reads about a page of index entries
per shard and the rows it shows, whatever the number of runs, so a tenant with 100,000
runs loads as fast as one with 10. The cursor is ``<created_at ms>.<run_id>`` of the
last row shown.

Filters (status) and text search (run id and prompt) have no index of their own: a
filtered page reads the index from its cursor onwards and keeps the rows that match,
examining at most ``SEARCH_WINDOW`` runs per request. When the window is spent before the
page is full the page says so and offers to search further back from where it stopped:
every request stays bounded, and nothing scans 100,000 runs at once. A search that is a
whole run id finds that run directly.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orchestrator.bounds import cut_text
from orchestrator.console.timeline import agent_of
from orchestrator.keys import run_id_error
from orchestrator.scrub import scrub_text

if TYPE_CHECKING:
    from orchestrator.store import RunStore

PAGE_SIZE = 50
SEARCH_WINDOW = 2000  # runs one filtered request examines at most
BATCH = 250  # index entries read per round trip while filtering
PROMPT_SHOWN = 140  # characters of the prompt in a row
FIELDS = ("status", "exit", "iteration", "tokens_used", "cost_usd", "error", "created_at", "spec", "tenant",
          "approvals_pending")  # fmt: skip
LIVE = ("queued", "running", "paused")
FILTERS = ("live", "waiting", "queued", "running", "paused", "completed", "failed", "aborted")
CURSOR = re.compile(r"(\d{1,16})\.([A-Za-z0-9_-]{1,64})")


@dataclass
class Row:
    run_id: str
    status: str
    exit: str | None
    model: str
    agent: str | None
    iteration: int
    tokens_used: int
    cost_usd: float
    created_at: int
    error: str | None
    prompt: str
    waiting: int  # calls waiting for approval


@dataclass
class Page:
    rows: list[Row] = field(default_factory=list)
    next_cursor: str | None = None
    scanned: int = 0  # runs examined (filtered pages)
    window_spent: bool = False  # the search stopped at SEARCH_WINDOW, not at the end


def parse_cursor(raw: str | None) -> tuple[int, str] | None:
    match = CURSOR.fullmatch(raw or "")
    return (int(match[1]), match[2]) if match else None


def cursor_of(score: int, run_id: str) -> str:
    return f"{score}.{run_id}"


def page(store: RunStore, tenant: str, status: str = "", q: str = "", before: str | None = None) -> Page:
    """One page of the tenant's runs after ``before``, matching ``status`` and ``q``."""
    status = status if status in FILTERS else ""
    q = q.strip()
    filtered = bool(status or q)
    cursor = parse_cursor(before)
    out, shown = Page(), []
    if q and cursor is None and not run_id_error(q):  # a whole run id: that run, first
        exact = [r for r in _rows(store, [q]) if r is not None and _owned(store, r, tenant)]
        shown += [r.run_id for r in exact if _status_ok(r.status, r.waiting, status)]
    while True:
        want = BATCH if filtered else PAGE_SIZE + 1 - len(shown)  # one more: is there a next page?
        ids = store.run_ids_before(tenant, cursor, want)
        keep = _matching(store, [i for _, i in ids], status, q) if filtered else {i for _, i in ids}
        for score, run_id in ids:
            if len(shown) == PAGE_SIZE and cursor:  # one more exists: the next page starts here
                out.next_cursor = cursor_of(*cursor)
                break
            cursor = (score, run_id)
            out.scanned += 1
            if run_id in keep and run_id not in shown:
                shown.append(run_id)
            if filtered and out.scanned >= SEARCH_WINDOW:
                out.window_spent, out.next_cursor = True, cursor_of(*cursor)
                break
        if out.next_cursor or len(ids) < want:  # a page full, the window spent, or the index's end
            out.rows = [row for row in _rows(store, shown) if row is not None]  # one round trip
            return out


def _matching(store: RunStore, run_ids: list[str], status: str, q: str) -> set[str]:
    """The runs that match, from the few fields that say so (one round trip): the status,
    and for a search the stored spec, parsed only when the text occurs in it at all."""
    fields = ("status", "approvals_pending", "spec") if q else ("status", "approvals_pending")
    pipe = store.redis.pipeline(transaction=False)
    for run_id in run_ids:
        pipe.hmget(store.keys.run(run_id), fields)
    needle, out = q.lower(), set()
    for run_id, values in zip(run_ids, pipe.execute(), strict=True):
        state, waiting = _text(values[0]), int(_text(values[1]) or 0)
        if state is None or not _status_ok(state, waiting, status):
            continue
        if not needle or needle in run_id.lower() or _in_prompt(needle, _text(values[2]) or ""):
            out.add(run_id)
    return out


def _in_prompt(needle: str, spec_json: str) -> bool:
    """``needle`` (lower case) is in the stored spec's prompt. Most specs do not hold it
    anywhere: those are not parsed (JSON escapes only quotes, backslashes and controls)."""
    if needle.isprintable() and "\\" not in needle and needle not in spec_json.lower():
        return False
    return needle in str(_spec(spec_json).get("prompt", "")).lower()


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _owned(store: RunStore, row: Row, tenant: str) -> bool:
    owner = store.redis.hget(store.keys.run(row.run_id), "tenant")
    return owner is not None and (owner.decode() if isinstance(owner, bytes) else owner) == tenant


def _status_ok(state: str, waiting: int, status: str) -> bool:
    if status == "live":
        return state in LIVE
    if status == "waiting":
        return waiting > 0 and state in LIVE
    return not status or state == status


def _spec(raw: str) -> dict[str, Any]:
    try:
        spec = json.loads(raw)
    except ValueError:
        return {}
    return spec if isinstance(spec, dict) else {}


def _rows(store: RunStore, run_ids: list[str]) -> list[Row | None]:
    """Each run's row (None for one that expired since the index was read): one round trip."""
    pipe = store.redis.pipeline(transaction=False)
    for run_id in run_ids:
        pipe.hmget(store.keys.run(run_id), FIELDS)
    return [_row(run_id, values) for run_id, values in zip(run_ids, pipe.execute(), strict=True)]


def _row(run_id: str, values: list[Any]) -> Row | None:
    v = dict(zip(FIELDS, (x.decode() if isinstance(x, bytes) else x for x in values), strict=True))
    if v["status"] is None:
        return None
    spec = _spec(v["spec"] or "{}")
    return Row(
        run_id=run_id, status=v["status"], exit=v["exit"] or None, model=str(spec.get("model", "?")),
        agent=agent_of(spec), iteration=int(v["iteration"] or 0), tokens_used=int(v["tokens_used"] or 0),
        cost_usd=float(v["cost_usd"] or 0), created_at=int(v["created_at"] or 0),
        error=cut_text(v["error"], 300) if v["error"] else None,
        prompt=cut_text(scrub_text(str(spec.get("prompt", ""))), PROMPT_SHOWN),
        waiting=int(v["approvals_pending"] or 0),
    )  # fmt: skip
