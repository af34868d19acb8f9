"""The console's controls: pause, resume, steer, abort, approve, deny, fork.

Each calls what the API and the CLI call (the store's directives, ``Client.resume``,
``Client.decide``), recorded ``by`` ``console:<tenant>``, and answers JSON the page shows
(``ok``, ``message``, ``status``): a refused action says why, with the API's status code
(404 no such run, 409 ended / not paused / already decided, 400 bad input). Without the
session's CSRF token the answer is 403 and nothing is done.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from orchestrator import control
from orchestrator.bounds import REASON_MAX_CHARS, STEER_MAX_CHARS
from orchestrator.console.auth import SESSION_COOKIE, csrf_ok
from orchestrator.console.web import Console, ConsoleState, Viewer, finish, owned, wants_json
from orchestrator.observation import observe_end

router = APIRouter(include_in_schema=False)
Csrf = Annotated[str, Form()]

DONE = {
    "pause": "Paused: nothing new starts until resume.",
    "resume": "Resumed.",
    "steer": "Steer queued: the model sees it at the next turn.",
    "abort": "Aborted.",
    "approve": "Approved: the call runs now.",
    "deny": "Denied: the model is told.",
}
REFUSED = {
    "ended": (409, "The run has already ended."),
    "not_paused": (409, "The run is not paused."),
    "full": (409, "Too many steer messages are waiting for the next turn."),
    "unknown": (404, "No such call is waiting for approval."),
    "missing": (404, "No such run."),
}


def _answer(request: Request, console: ConsoleState, run_id: str, action: str, verdict: str) -> Response:
    if verdict == "already":  # as the API: a pause of a paused run is fine, a second decision is not
        code, message = (
            (409, "That call was already decided.")
            if action in ("approve", "deny")
            else (200, "The run is already paused.")
        )
    elif verdict in REFUSED:
        code, message = REFUSED[verdict]
    else:
        code, message = 200, DONE[action]
    status = console.api.client.store.status(run_id)
    body = {
        "ok": code == 200,
        "action": action,
        "result": verdict,
        "message": message,
        "status": status.value if status else None,
    }
    return _reply(request, run_id, body, code)


def _reply(request: Request, run_id: str, body: dict, code: int) -> Response:
    if wants_json(request):
        return finish(request, JSONResponse(body, status_code=code))
    return finish(request, RedirectResponse(f"/runs/{run_id}", status_code=303))  # a form sent without script


def _check(
    request: Request, console: ConsoleState, viewer: Viewer, run_id: str, csrf: str
) -> Response | None:
    """403 without the CSRF token (nothing else is looked at); RunNotFound for another
    tenant's run."""
    if not csrf_ok(request, viewer, csrf):
        body = {"ok": False, "message": "Missing or wrong CSRF token: reload the page."}
        return finish(request, JSONResponse(body, status_code=403))
    owned(console, viewer, run_id)
    return None


def _by(viewer: Viewer) -> str:
    return f"console:{viewer.tenant}"


@router.post("/runs/{run_id}/pause")
def pause(request: Request, console: Console, viewer: Viewer, run_id: str, csrf: Csrf = "") -> Response:
    if refused := _check(request, console, viewer, run_id, csrf):
        return refused
    verdict = control.pause(console.api.client.store, run_id, _by(viewer))
    return _answer(request, console, run_id, "pause", verdict)


@router.post("/runs/{run_id}/resume")
def resume(request: Request, console: Console, viewer: Viewer, run_id: str, csrf: Csrf = "") -> Response:
    if refused := _check(request, console, viewer, run_id, csrf):
        return refused
    return _answer(request, console, run_id, "resume", console.api.client.resume(run_id, _by(viewer)))


@router.post("/runs/{run_id}/abort")
def abort(
    request: Request,
    console: Console,
    viewer: Viewer,
    run_id: str,
    csrf: Csrf = "",
    reason: Annotated[str, Form()] = "",
) -> Response:
    if refused := _check(request, console, viewer, run_id, csrf):
        return refused
    if len(reason) > REASON_MAX_CHARS:
        return _too_long(request, run_id, "reason", len(reason), REASON_MAX_CHARS)
    store = console.api.client.store
    verdict = control.abort(store, run_id, _by(viewer), reason.strip() or "aborted from the console")
    observe_end(store, run_id)  # as the API does: no task of the run may run again to see it
    return _answer(request, console, run_id, "abort", verdict)


@router.post("/runs/{run_id}/steer")
def steer(
    request: Request,
    console: Console,
    viewer: Viewer,
    run_id: str,
    csrf: Csrf = "",
    message: Annotated[str, Form()] = "",
) -> Response:
    if refused := _check(request, console, viewer, run_id, csrf):
        return refused
    if not message.strip():
        return _reply(request, run_id, {"ok": False, "message": "Type the guidance first."}, 400)
    if len(message) > STEER_MAX_CHARS:
        return _too_long(request, run_id, "message", len(message), STEER_MAX_CHARS)
    verdict = console.api.client.store.steer(run_id, message, by=_by(viewer))
    return _answer(request, console, run_id, "steer", verdict)


@router.post("/runs/{run_id}/calls/{call_id}/approve")
def approve(
    request: Request, console: Console, viewer: Viewer, run_id: str, call_id: str, csrf: Csrf = ""
) -> Response:
    if refused := _check(request, console, viewer, run_id, csrf):
        return refused
    verdict = console.api.client.decide(run_id, call_id, True, by=_by(viewer))
    return _answer(request, console, run_id, "approve", verdict)


@router.post("/runs/{run_id}/calls/{call_id}/deny")
def deny(
    request: Request,
    console: Console,
    viewer: Viewer,
    run_id: str,
    call_id: str,
    csrf: Csrf = "",
    reason: Annotated[str, Form()] = "",
) -> Response:
    if refused := _check(request, console, viewer, run_id, csrf):
        return refused
    if len(reason) > REASON_MAX_CHARS:
        return _too_long(request, run_id, "reason", len(reason), REASON_MAX_CHARS)
    verdict = console.api.client.decide(run_id, call_id, False, reason.strip(), by=_by(viewer))
    return _answer(request, console, run_id, "deny", verdict)


@router.post("/runs/{run_id}/fork")
def fork(
    request: Request,
    console: Console,
    viewer: Viewer,
    run_id: str,
    csrf: Csrf = "",
    at: Annotated[int, Form()] = 0,
) -> Response:
    """A fork at turn ``at`` (orchestrator/fork.py, as the API and the CLI): the answer names
    the new run, whose page the script opens."""
    from orchestrator.fork import ForkError, fork_run

    if refused := _check(request, console, viewer, run_id, csrf):
        return refused
    try:
        fork_id = fork_run(console.api.client, run_id, at, tenant=viewer.tenant, by=_by(viewer))
    except ForkError as exc:
        code = 404 if exc.kind == "not_found" else 400
        return _reply(request, run_id, {"ok": False, "message": str(exc)}, code)
    location = f"/runs/{fork_id}"
    body = {"ok": True, "action": "fork", "result": "ok", "run_id": fork_id, "location": location,
            "message": f"Forked at turn {at}: run {fork_id}."}  # fmt: skip
    if wants_json(request):
        return finish(request, JSONResponse(body))
    return finish(request, RedirectResponse(location, status_code=303))


def _too_long(request: Request, run_id: str, what: str, size: int, limit: int) -> Response:
    body = {"ok": False, "message": f"The {what} has {size:,} characters; the limit is {limit:,}."}
    return _reply(request, run_id, body, 400)


@router.post("/logout")
def logout(request: Request, viewer: Viewer, csrf: Csrf = "") -> Response:
    if not csrf_ok(request, viewer, csrf):
        return finish(request, JSONResponse({"ok": False, "message": "Missing or wrong CSRF token."}, 403))
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return finish(request, response)
