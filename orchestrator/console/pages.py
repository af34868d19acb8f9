"""The console's pages: sign-in, the runs list, a run's page, the fleet; and what their
script fetches to stay live (fragments of those pages, the run's event stream).

Reads are plain ``def`` routes (FastAPI runs them in its threadpool, as the API's);
the event stream is the API's own generator (``follow``), behind the session cookie.
"""

from __future__ import annotations

import re
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Form, Header, Query, Request
from fastapi.responses import RedirectResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

import orchestrator.console.listing as listing
import orchestrator.console.timeline as timeline
from orchestrator.console.auth import (
    LOGIN_COOKIE,
    LOGIN_MAX_AGE_S,
    SESSION_COOKIE,
    SESSION_MAX_AGE_S,
    set_cookie,
)
from orchestrator.console.web import Console, RunNotFound, Viewer, finish, owned, render, safe_next

router = APIRouter(include_in_schema=False)
STREAM_ID = re.compile(r"\d+(-\d+)?")
TOKEN_MAX_CHARS = 4096


# -- sign-in ---------------------------------------------------------------------------------------
@router.get("/login")
def login_page(request: Request, console: Console, next: str = "/") -> Response:
    return _login_form(request, console, next)


def _login_form(
    request: Request, console: Console, target: str, error: str = "", status: int = 200
) -> Response:
    nonce, vouch = console.sessions.login_nonce()
    response = render(
        request,
        "login.html",
        {
            "nonce": nonce,
            "next": safe_next(target),
            "error": error,
            "insecure": console.sessions.insecure_local,
        },
        status,
    )
    set_cookie(response, request, LOGIN_COOKIE, vouch, LOGIN_MAX_AGE_S)
    return response


@router.post("/login")
def login(
    request: Request,
    console: Console,
    token: Annotated[str, Form(max_length=TOKEN_MAX_CHARS)] = "",
    nonce: Annotated[str, Form(max_length=100)] = "",
    next: Annotated[str, Form()] = "/",
) -> Response:
    if not console.sessions.login_nonce_ok(request, nonce):
        return _login_form(request, console, next, "This sign-in form expired: try again.", 403)
    cookie = console.sessions.open(token.strip())
    if cookie is None:
        return _login_form(request, console, next, "Unknown token.", 401)
    response = RedirectResponse(safe_next(next), status_code=303)
    set_cookie(response, request, SESSION_COOKIE, cookie, SESSION_MAX_AGE_S)
    response.delete_cookie(LOGIN_COOKIE, path="/")
    return finish(request, response)


# -- the runs list -------------------------------------------------------------------------------
@router.get("/")
def runs_page(
    request: Request,
    console: Console,
    viewer: Viewer,
    status: str = "",
    q: str = "",
    before: str | None = None,
) -> Response:
    return render(request, "runs.html", _list_context(console, viewer.tenant, status, q, before))


@router.get("/partials/runs")
def runs_rows(
    request: Request,
    console: Console,
    viewer: Viewer,
    status: str = "",
    q: str = "",
    before: str | None = None,
) -> Response:
    """The list's rows, polled by the page's script: new runs and status changes appear."""
    return render(request, "_rows.html", _list_context(console, viewer.tenant, status, q, before))


def _list_context(console: Console, tenant: str, status: str, q: str, before: str | None) -> dict[str, Any]:
    q = q[:200]
    found = listing.page(console.api.client.store, tenant, status, q, before)
    wanted = {"status": status, "q": q}
    return {
        "query": _query(**wanted, before=before),
        "older": _query(**wanted, before=found.next_cursor) if found.next_cursor else None,
        "newest": _query(**wanted) if before else None,
        "page": found,
        "status": status if status in listing.FILTERS else "",
        "q": q,
        "before": before,
        "filters": listing.FILTERS,
        "page_size": listing.PAGE_SIZE,
        "window": listing.SEARCH_WINDOW,
    }


def _query(**params: str | None) -> str:
    return urlencode({k: v for k, v in params.items() if v})


# -- a run -----------------------------------------------------------------------------------------
@router.get("/runs/{run_id}")
def run_page(request: Request, console: Console, viewer: Viewer, run_id: str) -> Response:
    return render(request, "run.html", {"run": _run(console, viewer, run_id)})


@router.get("/runs/{run_id}/partials/live")
def run_live(
    request: Request, console: Console, viewer: Viewer, run_id: str, since: Annotated[int, Query(ge=0)] = 0
) -> Response:
    """The run's header and its turns from ``since`` on: what the page's script swaps in
    when an event says something changed."""
    return render(request, "_live.html", {"run": _run(console, viewer, run_id, since), "since": since})


def _run(console: Console, viewer: Viewer, run_id: str, since: int = 0) -> timeline.RunView:
    view = timeline.load(console.api.client.store, owned(console, viewer, run_id), since)
    if view is None:  # expired since the ownership check
        raise RunNotFound(run_id)
    return view


@router.get("/runs/{run_id}/events")
async def run_events(
    request: Request,
    console: Console,
    viewer: Viewer,
    run_id: str,
    after: str = "0",
    last_event_id: Annotated[str | None, Header()] = None,
) -> Response:
    """The API's event stream of the run (server-sent events), for a signed-in browser."""
    await run_in_threadpool(owned, console, viewer, run_id)
    start = last_event_id or after
    if not STREAM_ID.fullmatch(start):
        start = "0"
    stream = console.follow(console.api, request, run_id, start)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return finish(request, StreamingResponse(stream, media_type="text/event-stream", headers=headers))


# -- the fleet ---------------------------------------------------------------------------------------
@router.get("/fleet")
def fleet_page(request: Request, console: Console, viewer: Viewer) -> Response:
    return render(request, "fleet.html", _fleet(console, viewer.tenant))


@router.get("/partials/fleet")
def fleet_part(request: Request, console: Console, viewer: Viewer) -> Response:
    return render(request, "_fleet.html", _fleet(console, viewer.tenant))


def _fleet(console: Console, tenant: str) -> dict[str, Any]:
    """What ``tooloop doctor`` reports, from the same code, and this tenant's runs that
    wait for a person."""
    from orchestrator.approvals import waiting_runs
    from orchestrator.doctor import diagnose

    client = console.api.client
    report = diagnose(client.store)
    return {"report": report, "waiting": waiting_runs(client.store, tenant=tenant),
            "tenants": _shares_seen_by(report.pop("tenants", []), tenant)}


def _shares_seen_by(shares: list[dict[str, Any]], tenant: str) -> list[dict[str, Any]]:
    """Fair share as one tenant may see it: its own row, and the other tenants summed into
    one (their names and their own figures are theirs)."""
    own = [s for s in shares if s["tenant"] == tenant]
    others = [s for s in shares if s["tenant"] != tenant]
    if others:
        fields = ("weight", "active", "waiting", "tokens_minute", "tokens_total", "share")
        summed = {f: sum(s[f] for s in others) for f in fields}
        own.append({"tenant": f"other tenants ({len(others)})", "cap": None, **summed})
    return own
