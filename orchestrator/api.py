"""The operator HTTP API (``tooloop api``): submit, list, inspect, follow and control runs.

Every route under ``/api`` needs ``Authorization: Bearer <token>``; the token
names a tenant (``TOOLOOP_API_TOKENS="token=tenant,..."``) and a tenant only
sees its own runs: another tenant's run answers 404, exactly like a missing one.
``POST /api/runs`` submits through ``Client.submit``, so a spec is checked
exactly as a Python producer's is, for the token's tenant.

Store calls are synchronous Redis round trips, so the JSON routes are plain
``def`` routes (FastAPI runs them in its threadpool). The event stream is the
exception: a follower may wait minutes for the next event, and holding a pool
thread per follower would starve the other routes, so it reads the run's Redis
Stream with an asyncio Redis client instead. Nothing is ever pushed to a
follower: each one reads the stream at its own pace, so a slow or vanished
follower cannot slow a run.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Annotated, Any

import redis.asyncio as aioredis
from fastapi import APIRouter, Body, Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field

from orchestrator import console, control, metrics
from orchestrator.api_state import ApiState
from orchestrator.bounds import API_BODY_MAX_BYTES, TooLong
from orchestrator.client import Client
from orchestrator.connections import connect_async
from orchestrator.events import Event
from orchestrator.events import parse as parse_event
from orchestrator.models import ForkedFrom, RunResult, Status
from orchestrator.observation import observe_end
from orchestrator.settings import Settings, get_settings
from orchestrator.tokens import match_token as _match_token
from orchestrator.tokens import token_digest
from orchestrator.validation import SpecError
from orchestrator.views import RunSummary

BLOCK_MS = 5000  # one XREAD BLOCK; also how often a follower re-checks its connection
HEARTBEAT_S = 15.0  # an SSE comment when idle this long: keeps proxies from timing out
SHUTDOWN_GRACE_S = 5  # open event streams of live runs must not hold up a restart
STREAM_ID = re.compile(r"\d+(-\d+)?")  # a Redis Stream id, as sent back in Last-Event-ID
FIELD_PATH = re.compile(r"[A-Za-z_][\w]*(\.[\w]+)*")  # how validation names a spec field


# -- bodies and replies -----------------------------------------------------------
class SteerBody(BaseModel):
    message: str = Field(description="guidance added at the run's next turn boundary")


class AbortBody(BaseModel):
    reason: str = Field(default="abort requested", description="recorded in the run's error")


class Submitted(BaseModel):
    run_id: str
    status: Status = Field(description="queued, right after submit")
    warnings: list[str] = Field(default_factory=list, description="from validation (a missing steering file)")


class ForkBody(BaseModel):
    at: int = Field(description="the turn the fork starts at: 1 .. the run's turns + 1")
    prompt_append: str | None = Field(default=None, description="an instruction ending the fork's history")
    model: str | None = Field(default=None, description="the model the fork runs on (default: the parent's)")


class ForkReply(BaseModel):
    run_id: str
    status: Status = Field(description="queued, right after the fork")
    forked_from: ForkedFrom


class Problem(BaseModel):
    detail: str


class ValidationProblem(BaseModel):
    """FastAPI's own shape for 422, also used for a refused spec (one item per fault)."""

    detail: list[dict[str, Any]]


class ControlReply(BaseModel):
    run_id: str
    action: str
    result: str = Field(description="ok, or already (a pause on a paused run)")
    status: Status | None = Field(description="the run's status right after the directive")


# -- dependencies -------------------------------------------------------------------
bearer = HTTPBearer(auto_error=False, description="a token listed in TOOLOOP_API_TOKENS")


def _api(request: Request) -> ApiState:
    return request.app.state.api


Api = Annotated[ApiState, Depends(_api)]


Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


async def _tenant(api: Api, creds: Credentials) -> str:
    """The tenant the bearer token maps to; 401 without a known token."""
    tenant = _match_token(api.tokens, creds.credentials) if creds else None
    if tenant is None:
        raise HTTPException(401, "missing or unknown bearer token", {"WWW-Authenticate": "Bearer"})
    return tenant


Tenant = Annotated[str, Depends(_tenant)]


def _owned_run(run_id: str, tenant: Tenant, api: Api) -> str:
    """The run id, if the run exists and belongs to the caller's tenant; else 404."""
    store = api.client.store
    owner = store.redis.hget(store.keys.run(run_id), "tenant")
    if owner is None or owner.decode() != tenant:
        raise HTTPException(404, f"no run {run_id!r}")
    return run_id


OwnedRun = Annotated[str, Depends(_owned_run)]

# Every status code a route can answer is listed, so a client generated from the
# OpenAPI document (or a schemathesis run) meets no undocumented one.
UNAUTHORIZED: dict[int | str, dict[str, Any]] = {
    401: {"model": Problem, "description": "missing or unknown bearer token"},
}
# limit_body answers this on any route, whatever the route itself reads.
BODY_REFUSED = "request body too large or without a Content-Length"
TOO_LARGE: dict[int | str, dict[str, Any]] = {400: {"model": Problem, "description": BODY_REFUSED}}


def bad_request(why: str) -> dict[int | str, dict[str, Any]]:
    """A route's own 400, listed with limit_body's (a route's entry replaces the router's)."""
    return {400: {"model": Problem, "description": f"{why}; or {BODY_REFUSED}"}}


NO_RUN: dict[int | str, dict[str, Any]] = {
    404: {"model": Problem, "description": "no such run (or another tenant's)"},
}
router = APIRouter(prefix="/api", tags=["runs"], responses={**TOO_LARGE, **UNAUTHORIZED})


# -- submitting -------------------------------------------------------------------------
TENANT_FIELD = "tenant"


@router.post(
    "/runs",
    status_code=201,
    responses={422: {"model": ValidationProblem, "description": "the spec was refused; each fault named"}},
)
def submit_run(
    tenant: Tenant,
    api: Api,
    spec: Annotated[dict[str, Any], Body(description="a run spec, as in a spec file (JSON)")],
) -> Submitted:
    """Submit a run for the token's tenant; the reply holds its id.

    The spec is validated exactly as `Client.submit` validates it, and nothing
    is written or enqueued when it is refused. A spec naming another tenant is refused.
    """
    given = spec.get(TENANT_FIELD)
    if given is not None and given != tenant:
        raise HTTPException(422, _problems([f"{TENANT_FIELD}: this token submits for {tenant!r} only"]))
    try:
        handle = api.client.submit({**spec, TENANT_FIELD: tenant})
    except SpecError as exc:
        raise HTTPException(422, _problems(exc.errors)) from None
    return Submitted(run_id=handle.run_id, status=Status.queued, warnings=handle.warnings)


def _problems(errors: list[str]) -> list[dict[str, Any]]:
    """Spec faults in the shape of FastAPI's own 422 (``loc``, ``msg``, ``type``)."""
    return [{"loc": ["body", *_field(e)], "msg": e, "type": "spec_refused"} for e in errors]


def _field(error: str) -> list[str]:
    """``model_params.api_key_env: ...`` -> [model_params, api_key_env]; else nothing."""
    head = error.split(":", 1)[0]
    return head.split(".") if ":" in error and FIELD_PATH.fullmatch(head) else []


# -- reading --------------------------------------------------------------------------
@router.get("/runs", response_model=list[RunSummary])
def list_runs(tenant: Tenant, api: Api, limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> list[RunSummary]:
    """The caller's recent runs, newest first."""
    return [RunSummary.from_row(row) for row in api.client.list(limit, tenant)]


@router.get("/runs/{run_id}", response_model=RunResult, responses=NO_RUN)
def get_run(run_id: OwnedRun, api: Api) -> RunResult:
    """A run's state and result, as `tooloop status RUN --json` prints it."""
    result = api.client.store.result(run_id)
    if result is None:  # expired since the ownership check
        raise HTTPException(404, f"no run {run_id!r}")
    return result


@router.get(
    "/runs/{run_id}/events",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}},
                     "description": "server-sent events, live; the stream ends after `outcome`"},
               **bad_request("Last-Event-ID is not a stream id"),
               **NO_RUN},
)  # fmt: skip
async def run_events(
    run_id: OwnedRun,
    api: Api,
    request: Request,
    last_event_id: Annotated[str | None, Header()] = None,
) -> StreamingResponse:
    """Progress events from the start (or after `Last-Event-ID`), live until the outcome.

    Each event is `id: <stream id>`, `event: <type>` and `data: <the event's typed JSON>`
    (numbers as numbers, booleans as booleans, `ts` in ISO 8601).
    A finished run replays its events and the stream ends.
    """
    after = last_event_id or "0"
    if not STREAM_ID.fullmatch(after):
        raise HTTPException(400, f"Last-Event-ID {after!r} is not a stream id (like 1700000000000-0)")
    stream = follow(api, request, run_id, after)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(stream, media_type="text/event-stream", headers=headers)


async def follow(api: ApiState, request: Request, run_id: str, after: str) -> AsyncIterator[str]:
    """SSE frames for one follower; ends at the outcome, or when the follower leaves."""
    assert api.events_redis is not None, "the app's lifespan opens the events client"
    r, keys = api.events_redis, api.client.store.keys
    api.open_streams += 1
    idle_s = 0.0
    try:
        while not await request.is_disconnected():
            entries = await _read(r, keys.events(run_id), after, BLOCK_MS)
            if not entries and await _over(r, keys.run(run_id)):
                entries = await _read(r, keys.events(run_id), after, None)  # ended just now?
                if not entries:
                    return
            for event in entries:
                after = event.id
                yield sse_frame(event)
                if event.type == "outcome":
                    return
            idle_s = 0.0 if entries else idle_s + BLOCK_MS / 1000
            if idle_s >= HEARTBEAT_S:
                idle_s = 0.0
                yield ": keepalive\n\n"  # a dead connection fails on this send
    finally:
        api.open_streams -= 1


async def _read(r: aioredis.Redis, key: str, after: str, block_ms: int | None) -> list[Event]:
    resp = await r.xread({key: after}, count=100, block=block_ms)
    return [parse_event(event_id, fields) for event_id, fields in resp[0][1]] if resp else []


async def _over(r: aioredis.Redis, run_key: str) -> bool:
    """The run has ended, or expired: no more events will come."""
    status = await r.hget(run_key, "status")
    return status is None or Status(status).ended


def sse_frame(event: Event) -> str:
    """One server-sent event: the typed event's JSON (numbers as numbers, times in ISO 8601)."""
    # model_dump_json is the JSON of model_dump(mode="json"), compact
    return f"id: {event.id}\nevent: {event.type}\ndata: {event.model_dump_json()}\n\n"


# -- control ---------------------------------------------------------------------------
_REFUSED = {"ended": "has already ended", "not_paused": "is not paused",
            "full": "has too many steer messages waiting"}  # fmt: skip


def _reply(api: ApiState, run_id: str, action: str, verdict: str) -> ControlReply:
    if verdict == "missing":
        raise HTTPException(404, f"no run {run_id!r}")
    if verdict in _REFUSED:
        raise HTTPException(409, f"run {run_id} {_REFUSED[verdict]}")
    return ControlReply(run_id=run_id, action=action, result=verdict,
                        status=api.client.store.status(run_id))  # fmt: skip


@contextmanager
def _bounded() -> Iterator[None]:
    """A text over its bound (orchestrator/bounds.py, checked by the store for every
    entrance) answers 400; nothing was written."""
    try:
        yield
    except TooLong as exc:
        raise HTTPException(400, str(exc)) from None


CONTROL_ERRORS: dict[int | str, dict[str, Any]] = {
    **NO_RUN,
    409: {"model": Problem, "description": "the run has ended (or, for resume, is not paused)"},
}


@router.post("/runs/{run_id}/pause", responses=CONTROL_ERRORS)
def pause(run_id: OwnedRun, tenant: Tenant, api: Api) -> ControlReply:
    """Park the run in Redis: no model or tool call starts until resume."""
    return _reply(api, run_id, "pause", control.pause(api.client.store, run_id, by=f"api:{tenant}"))


@router.post("/runs/{run_id}/resume", responses=CONTROL_ERRORS)
def resume(run_id: OwnedRun, tenant: Tenant, api: Api) -> ControlReply:
    """Resume a paused run: its next step is enqueued."""
    return _reply(api, run_id, "resume", api.client.resume(run_id, by=f"api:{tenant}"))


@router.post("/runs/{run_id}/abort",
             responses={**CONTROL_ERRORS,
                        **bad_request("a reason over the length limit")})
def abort(
    run_id: OwnedRun, tenant: Tenant, api: Api, body: Annotated[AbortBody | None, Body()] = None
) -> ControlReply:
    """End the run now: status and exit `aborted`; an in-flight reply is discarded."""
    reason = (body or AbortBody()).reason
    with _bounded():
        verdict = control.abort(api.client.store, run_id, f"api:{tenant}", reason)
    reply = _reply(api, run_id, "abort", verdict)
    observe_end(api.client.store, run_id)  # no task of the run may run again to see it
    return reply


@router.post(
    "/runs/{run_id}/steer",
    responses={**CONTROL_ERRORS,
               **bad_request("blank message, or one over the length limit")},
)
def steer(run_id: OwnedRun, tenant: Tenant, api: Api, body: SteerBody) -> ControlReply:
    """Queue guidance; it reaches the model at the run's next turn boundary."""
    if not body.message.strip():
        raise HTTPException(400, "message must not be blank")
    with _bounded():
        verdict = api.client.store.steer(run_id, body.message, by=f"api:{tenant}")
    return _reply(api, run_id, "steer", verdict)


@router.post(
    "/runs/{run_id}/fork",
    status_code=201,
    responses={**NO_RUN, **bad_request("a turn the run cannot be forked at, or a blank prompt_append"),
               422: {"model": ValidationProblem, "description": "the model given is refused"}},
)  # fmt: skip
def fork(run_id: OwnedRun, tenant: Tenant, api: Api, body: ForkBody) -> ForkReply:
    """A new run whose history is this run's as it stood when turn `at` began; nothing
    before `at` runs again, and the run itself goes on untouched."""
    from orchestrator.fork import ForkError, fork_run

    try:
        fork_id = fork_run(api.client, run_id, body.at, body.prompt_append, body.model, tenant,
                           by=f"api:{tenant}")  # fmt: skip
    except ForkError as exc:
        if exc.kind == "not_found":
            raise HTTPException(404, f"no run {run_id!r}") from None
        if exc.kind == "spec_refused":
            raise HTTPException(422, _problems(str(exc).split("; "))) from None
        raise HTTPException(400, str(exc)) from None
    return ForkReply(run_id=fork_id, status=Status.queued,
                     forked_from=ForkedFrom(run_id=run_id, iteration=body.at))  # fmt: skip


class DenyBody(BaseModel):
    reason: str = Field(default="denied by a person", description="told to the model with the failed call")


DECISION_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": Problem, "description": "no such run (or another tenant's), or no such call waiting"},
    409: {"model": Problem, "description": "the run has ended, or the call was already decided"},
}


def _decision(api: ApiState, run_id: str, call_id: str, action: str, verdict: str) -> ControlReply:
    if verdict in ("missing", "unknown"):
        raise HTTPException(404, f"run {run_id!r} has no call {call_id!r} waiting for approval")
    if verdict == "ended":
        raise HTTPException(409, f"run {run_id} has already ended")
    if verdict == "already":
        raise HTTPException(409, f"call {call_id} was already decided")
    return ControlReply(run_id=run_id, action=action, result=verdict,
                        status=api.client.store.status(run_id))  # fmt: skip


@router.post("/runs/{run_id}/calls/{call_id}/approve", responses=DECISION_ERRORS)
def approve(run_id: OwnedRun, call_id: str, tenant: Tenant, api: Api) -> ControlReply:
    """Let a call waiting for approval run (`call_id`: the model's tool call id)."""
    verdict = api.client.decide(run_id, call_id, True, by=f"api:{tenant}")
    return _decision(api, run_id, call_id, "approve", verdict)


@router.post("/runs/{run_id}/calls/{call_id}/deny",
             responses={**DECISION_ERRORS,
                        **bad_request("a reason over the length limit")})
def deny(
    run_id: OwnedRun, call_id: str, tenant: Tenant, api: Api, body: Annotated[DenyBody | None, Body()] = None
) -> ControlReply:
    """Refuse a call waiting for approval: the model gets a failed record with the reason."""
    reason = (body or DenyBody()).reason
    with _bounded():
        verdict = api.client.decide(run_id, call_id, False, reason, by=f"api:{tenant}")
    return _decision(api, run_id, call_id, "deny", verdict)


# -- the app ------------------------------------------------------------------------------
def create_app(settings: Settings | None = None, client: Client | None = None,
               insecure_local: bool = False) -> FastAPI:  # fmt: skip
    """The API, and the run console at ``/`` (``insecure_local``: the console signs every
    browser in as the ``default`` tenant, without a token: for a laptop, bound to loopback)."""
    settings = settings or get_settings()
    tokens = {token_digest(token): tenant for token, tenant in settings.tenant_tokens().items()}
    state = ApiState(client=client or Client(settings), tokens=tokens)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The socket must outlast one XREAD BLOCK.
        state.events_redis = connect_async(  # whatever the store's shape: Sentinel, Cluster
            settings.redis_url, decode_responses=True, socket_timeout=BLOCK_MS / 1000 + 10
        )
        try:
            yield
        finally:
            await state.events_redis.aclose()

    app = FastAPI(
        title="tooloop operator API",
        version="1",
        description="List, inspect, follow and control tooloop runs. "
        "Bearer tokens map to tenants (TOOLOOP_API_TOKENS).",
        lifespan=lifespan,
    )
    app.state.api = state
    app.middleware("http")(limit_body)
    metrics.count_here()
    state.metrics = metrics.registry(settings, multiprocess=False)
    app.include_router(router)
    console.install(app, state, follow, settings.secret_key, insecure_local)
    app.add_api_route("/api/health", health, methods=["GET"], tags=["health"],
                      responses={**TOO_LARGE, 503: {"model": Problem, "description": "Redis unreachable"}})
    app.add_api_route("/metrics", metrics_page, methods=["GET"], tags=["health"], response_class=Response,
                      responses={200: {"content": {"text/plain": {}},
                                       "description": "Prometheus text format"}, **TOO_LARGE})  # fmt: skip
    return app


async def limit_body(request: Request, call_next: Any) -> Any:
    """A body over API_BODY_MAX_BYTES is refused (400) before anything reads it whole."""
    size = request.headers.get("content-length")
    if size is not None and (not size.isdigit() or int(size) > API_BODY_MAX_BYTES):
        return JSONResponse({"detail": f"request body over {API_BODY_MAX_BYTES:,} bytes"}, status_code=400)
    if size is None and request.headers.get("transfer-encoding"):  # chunked: no size to check first
        return JSONResponse({"detail": "a request body needs a Content-Length"}, status_code=400)
    return await call_next(request)


def health(api: Api, creds: Credentials) -> dict[str, Any]:
    """Liveness, without a token: the API answers and Redis answers, `{"ok": true}`. With a
    valid token, also each live worker's sandbox layers (`sandbox`): worker names and the
    layers that are off tell an attacker where to aim, so nobody without a token sees them."""
    try:
        redis_ok = bool(api.client.store.redis.ping())
    except Exception:
        redis_ok = False
    if not redis_ok:
        raise HTTPException(503, "Redis unreachable")
    if creds is None or _match_token(api.tokens, creds.credentials) is None:
        return {"ok": True}
    from orchestrator.doctor import sandbox_report

    return {"ok": True, "sandbox": sandbox_report(api.client.store)}


def metrics_page(api: Api) -> Response:
    """Prometheus metrics, without a token: queue depth, live and paused runs, this process's counts."""
    body, content_type = metrics.exposition(api.metrics)
    return Response(body, media_type=content_type)


def serve(host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          insecure_local: bool = False) -> None:  # fmt: skip
    import uvicorn

    app = create_app(insecure_local=insecure_local)
    uvicorn.run(app, host=host, port=port, log_level=log_level, log_config=_log_config(),
                timeout_graceful_shutdown=SHUTDOWN_GRACE_S)  # fmt: skip


def _log_config() -> dict[str, Any]:
    """uvicorn's logging, in JSON lines when TOOLOOP_LOG_FORMAT=json."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    if get_settings().log_format == "json":
        for name in config["formatters"]:
            config["formatters"][name] = {"()": "orchestrator.logs.JsonFormatter"}
    return config
