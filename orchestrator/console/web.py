"""The console's plumbing: its state on the app, templates, the viewer's session, errors.

Pages are rendered by Jinja2 with autoescape on: every value a run holds (model text,
tool output, prompt) is escaped where it is shown. Every console response carries a
Content-Security-Policy that allows scripts, styles and connections to this server
only, and no inline script: injected markup could not run even if some escaped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import jinja2
from fastapi import Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from orchestrator.console.auth import SESSION_COOKIE, SESSION_MAX_AGE_S, Session, Sessions, set_cookie

if TYPE_CHECKING:
    from orchestrator.api_state import ApiState

PACKAGE = files("orchestrator.console")
TEMPLATES = Path(str(PACKAGE / "templates"))
STATIC = Path(str(PACKAGE / "static"))
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


@dataclass
class ConsoleState:
    api: ApiState  # the operator API's state: the same client, store and tokens
    sessions: Sessions
    follow: Callable[..., Any]  # the API's event-stream generator (orchestrator/api.py follow)
    static_version: str  # appended to static URLs: a new release is not served from cache


def static_version() -> str:
    digest = hashlib.sha256()
    for path in sorted(STATIC.iterdir()):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


# -- templates -----------------------------------------------------------------------------------
def _when(value: datetime | int | None) -> datetime | None:
    """A time: an event's ``ts`` (datetime) or a state field (ms since the epoch)."""
    if isinstance(value, datetime):
        return value
    return datetime.fromtimestamp(value / 1000, UTC) if value else None


def _iso(value: datetime | int | None) -> str:
    when = _when(value)
    return when.isoformat(timespec="seconds") if when else ""


def _utc(value: datetime | int | None) -> str:
    """A time as UTC text; the page's script shows it in the viewer's zone."""
    when = _when(value)
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if when else "-"


def _usd(value: float | None) -> str:
    if value is None:
        return "-"
    return f"${value:.4f}" if value < 100 else f"${value:,.2f}"


def _num(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _duration(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms:.0f} ms" if ms < 10_000 else f"{ms / 1000:.1f} s"


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                             trim_blocks=True, lstrip_blocks=True)  # fmt: skip
    env.filters.update(iso=_iso, utc=_utc, usd=_usd, num=_num, duration=_duration)
    return env


templates = Jinja2Templates(env=_env())


def render(request: Request, name: str, context: dict[str, Any], status: int = 200) -> HTMLResponse:
    console: ConsoleState = request.app.state.console
    session: Session | None = getattr(request.state, "session", None)
    base = {"static_v": console.static_version, "session": session}
    response = templates.TemplateResponse(request, name, {**base, **context}, status_code=status)
    return finish(request, response)


def finish(request: Request, response: Response) -> Response:
    """Security headers, and the cookie of a session opened during this request."""
    response.headers.update(SECURITY_HEADERS)
    cookie = getattr(request.state, "new_session", None)
    if cookie:
        set_cookie(response, request, SESSION_COOKIE, cookie, SESSION_MAX_AGE_S)
    return response


# -- the viewer ------------------------------------------------------------------------------------
class SignInNeeded(Exception):
    """No valid session: a page redirects to /login, a script's request gets 401."""


class RunNotFound(Exception):
    """No such run, or another tenant's: the same 404."""

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id)
        self.run_id = run_id


def _console(request: Request) -> ConsoleState:
    return request.app.state.console


Console = Annotated[ConsoleState, Depends(_console)]


def _viewer(request: Request, console: Console) -> Session:
    session = console.sessions.read(request)
    if session is None and console.sessions.insecure_local:
        cookie = console.sessions.open_local()  # a session of its own: the CSRF token is per browser
        request.state.new_session = cookie
        session = console.sessions.read_value(cookie)
    if session is None:
        raise SignInNeeded
    request.state.session = session
    return session


Viewer = Annotated[Session, Depends(_viewer)]


def owned(console: ConsoleState, viewer: Session, run_id: str) -> str:
    """``run_id`` if the run exists and is the viewer's tenant's; else RunNotFound."""
    store = console.api.client.store
    owner = store.redis.hget(store.keys.run(run_id), "tenant")
    if owner is None or owner.decode() != viewer.tenant:
        raise RunNotFound(run_id)
    return run_id


def wants_json(request: Request) -> bool:
    return "application/json" in request.headers.get("accept", "")


async def on_sign_in_needed(request: Request, exc: Exception) -> Response:
    if wants_json(request) or request.method != "GET" or "/partials/" in request.url.path:
        return finish(request, JSONResponse({"ok": False, "message": "sign in first"}, status_code=401))
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return finish(request, RedirectResponse(f"/login?next={_quote(target)}", status_code=303))


async def on_run_not_found(request: Request, exc: Exception) -> Response:
    run_id = exc.run_id if isinstance(exc, RunNotFound) else "?"
    if wants_json(request) or request.method != "GET" or "/partials/" in request.url.path:
        return finish(request, JSONResponse({"ok": False, "message": f"no run {run_id!r}"}, status_code=404))
    return render(request, "missing.html", {"run_id": run_id}, status=404)


def _quote(path: str) -> str:
    from urllib.parse import quote

    return quote(path, safe="/")


def safe_next(target: str | None) -> str:
    """Where to go after signing in: a path of this server only (no open redirect)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target
