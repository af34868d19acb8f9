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
from orchestrator.scrub import scrub_text
from orchestrator.validation import run_id_error

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
    haystack: str = field(default="", repr=False)  # what a search looks in: id and whole prompt


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
    out = Page()
    if q and cursor is None and not run_id_error(q):
        out.rows += [r for r in _rows(store, [q]) if r is not None and _owned(store, r, tenant)
                     and _status_ok(r, status)]  # fmt: skip
    while True:
        want = BATCH if filtered else PAGE_SIZE + 1 - len(out.rows)  # one more: is there a next page?
        ids = store.run_ids_before(tenant, cursor, want)
        for (score, run_id), row in zip(ids, _rows(store, [i for _, i in ids]), strict=True):
            if len(out.rows) == PAGE_SIZE and cursor:  # one more exists: the next page starts here
                out.next_cursor = cursor_of(*cursor)
                return out
            cursor = (score, run_id)
            out.scanned += 1
            if row is not None and _matches(row, status, q) and not _listed(out, run_id):
                out.rows.append(row)
            if filtered and out.scanned >= SEARCH_WINDOW:
                out.window_spent, out.next_cursor = True, cursor_of(*cursor)
                return out
        if len(ids) < want:
            return out  # the index ends here


def _listed(out: Page, run_id: str) -> bool:
    return any(r.run_id == run_id for r in out.rows)


def _owned(store: RunStore, row: Row, tenant: str) -> bool:
    owner = store.redis.hget(store.keys.run(row.run_id), "tenant")
    return owner is not None and (owner.decode() if isinstance(owner, bytes) else owner) == tenant


def _status_ok(row: Row, status: str) -> bool:
    if status == "live":
        return row.status in LIVE
    if status == "waiting":
        return row.waiting > 0 and row.status in LIVE
    return not status or row.status == status


def _matches(row: Row, status: str, q: str) -> bool:
    if not _status_ok(row, status):
        return False
    return not q or q.lower() in row.haystack


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
    try:
        spec = json.loads(v["spec"] or "{}")
    except ValueError:
        spec = {}
    spec = spec if isinstance(spec, dict) else {}
    return Row(
        run_id=run_id, status=v["status"], exit=v["exit"] or None, model=str(spec.get("model", "?")),
        agent=agent_of(spec), iteration=int(v["iteration"] or 0), tokens_used=int(v["tokens_used"] or 0),
        cost_usd=float(v["cost_usd"] or 0), created_at=int(v["created_at"] or 0),
        error=cut_text(v["error"], 300) if v["error"] else None,
        prompt=cut_text(scrub_text(str(spec.get("prompt", ""))), PROMPT_SHOWN),
        waiting=int(v["approvals_pending"] or 0),
        haystack=f"{run_id}\n{spec.get('prompt', '')}".lower(),
    )  # fmt: skip
