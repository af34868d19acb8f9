"""The operator HTTP API (``tooloop api``): list, inspect, follow and control runs.

Every route under ``/api`` needs ``Authorization: Bearer <token>``; the token
names a tenant (``TOOLOOP_API_TOKENS="token=tenant,..."``) and a tenant only
sees its own runs: another tenant's run answers 404, exactly like a missing one.

Store calls are synchronous Redis round trips, so the JSON routes are plain
``def`` routes (FastAPI runs them in its threadpool). The event stream is the
exception: a follower may wait minutes for the next event, and holding a pool
thread per follower would starve the other routes, so it reads the run's Redis
Stream with an asyncio Redis client instead. Nothing is ever pushed to a
follower: each one reads the stream at its own pace, so a slow or vanished
follower cannot slow a run.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

import redis.asyncio as aioredis
from fastapi import APIRouter, Body, Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field

from orchestrator.client import Client
from orchestrator.models import RunResult, Status
from orchestrator.settings import Settings, get_settings
from orchestrator.views import RunSummary

BLOCK_MS = 5000  # one XREAD BLOCK; also how often a follower re-checks its connection
HEARTBEAT_S = 15.0  # an SSE comment when idle this long: keeps proxies from timing out
SHUTDOWN_GRACE_S = 5  # open event streams of live runs must not hold up a restart
STREAM_ID = re.compile(r"\d+(-\d+)?")  # a Redis Stream id, as sent back in Last-Event-ID


@dataclass
class ApiState:
    client: Client
    tokens: dict[str, str]  # bearer token -> tenant
    events_redis: aioredis.Redis | None = None  # opened in the app's lifespan
    open_streams: int = 0  # event streams being served right now


# -- bodies and replies -----------------------------------------------------------
class SteerBody(BaseModel):
    message: str = Field(description="guidance added at the run's next turn boundary")


class AbortBody(BaseModel):
    reason: str = Field(default="abort requested", description="recorded in the run's error")


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


async def _tenant(api: Api, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> str:
    """The tenant the bearer token maps to; 401 without a known token."""
    tenant = _match_token(api.tokens, creds.credentials) if creds else None
    if tenant is None:
        raise HTTPException(401, "missing or unknown bearer token", {"WWW-Authenticate": "Bearer"})
    return tenant


def _match_token(tokens: dict[str, str], given: str) -> str | None:
    # compare_digest against every token: the answer time says nothing about near misses
    found = None
    for token, tenant in tokens.items():
        if hmac.compare_digest(token.encode(), given.encode()):
            found = tenant
    return found


Tenant = Annotated[str, Depends(_tenant)]


def _owned_run(run_id: str, tenant: Tenant, api: Api) -> str:
    """The run id, if the run exists and belongs to the caller's tenant; else 404."""
    store = api.client.store
    owner = store.redis.hget(store.keys.run(run_id), "tenant")
    if owner is None or owner.decode() != tenant:
        raise HTTPException(404, f"no run {run_id!r}")
    return run_id


OwnedRun = Annotated[str, Depends(_owned_run)]

router = APIRouter(prefix="/api", tags=["runs"])


# -- reading --------------------------------------------------------------------------
@router.get("/runs", response_model=list[RunSummary])
def list_runs(tenant: Tenant, api: Api, limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> list[RunSummary]:
    """The caller's recent runs, newest first."""
    return [RunSummary.from_row(row) for row in api.client.list(limit, tenant)]


@router.get("/runs/{run_id}", response_model=RunResult, responses={404: {"description": "no such run"}})
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
                     "description": "server-sent events, live; the stream ends after `outcome`"}},
)  # fmt: skip
async def run_events(
    run_id: OwnedRun,
    api: Api,
    request: Request,
    last_event_id: Annotated[str | None, Header()] = None,
) -> StreamingResponse:
    """Progress events from the start (or after `Last-Event-ID`), live until the outcome.

    Each event is `id: <stream id>`, `event: <type>` and `data: <JSON of its fields>`.
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
            for event_id, fields in entries:
                after = event_id
                yield sse_frame(event_id, fields)
                if fields.get("type") == "outcome":
                    return
            idle_s = 0.0 if entries else idle_s + BLOCK_MS / 1000
            if idle_s >= HEARTBEAT_S:
                idle_s = 0.0
                yield ": keepalive\n\n"  # a dead connection fails on this send
    finally:
        api.open_streams -= 1


async def _read(
    r: aioredis.Redis, key: str, after: str, block_ms: int | None
) -> list[tuple[str, dict[str, str]]]:
    resp = await r.xread({key: after}, count=100, block=block_ms)
    return list(resp[0][1]) if resp else []


async def _over(r: aioredis.Redis, run_key: str) -> bool:
    """The run has ended, or expired: no more events will come."""
    status = await r.hget(run_key, "status")
    return status is None or Status(status).ended


def sse_frame(event_id: str, fields: dict[str, str]) -> str:
    data = json.dumps({"id": event_id, **fields}, separators=(",", ":"))
    return f"id: {event_id}\nevent: {fields.get('type', 'message')}\ndata: {data}\n\n"


# -- control ---------------------------------------------------------------------------
_REFUSED = {"ended": "has already ended", "not_paused": "is not paused"}


def _reply(api: ApiState, run_id: str, action: str, verdict: str) -> ControlReply:
    if verdict == "missing":
        raise HTTPException(404, f"no run {run_id!r}")
    if verdict in _REFUSED:
        raise HTTPException(409, f"run {run_id} {_REFUSED[verdict]}")
    return ControlReply(run_id=run_id, action=action, result=verdict,
                        status=api.client.store.status(run_id))  # fmt: skip


CONTROL_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"description": "no such run (or another tenant's)"},
    409: {"description": "the run has ended (or, for resume, is not paused)"},
}


@router.post("/runs/{run_id}/pause", responses=CONTROL_ERRORS)
def pause(run_id: OwnedRun, tenant: Tenant, api: Api) -> ControlReply:
    """Park the run in Redis: no model or tool call starts until resume."""
    return _reply(api, run_id, "pause", api.client.store.pause(run_id, by=f"api:{tenant}"))


@router.post("/runs/{run_id}/resume", responses=CONTROL_ERRORS)
def resume(run_id: OwnedRun, tenant: Tenant, api: Api) -> ControlReply:
    """Resume a paused run: its next step is enqueued."""
    return _reply(api, run_id, "resume", api.client.resume(run_id, by=f"api:{tenant}"))


@router.post("/runs/{run_id}/abort", responses=CONTROL_ERRORS)
def abort(
    run_id: OwnedRun, tenant: Tenant, api: Api, body: Annotated[AbortBody | None, Body()] = None
) -> ControlReply:
    """End the run now: status and exit `aborted`; an in-flight reply is discarded."""
    reason = (body or AbortBody()).reason
    return _reply(api, run_id, "abort", api.client.store.abort(run_id, f"api:{tenant}", reason))


@router.post(
    "/runs/{run_id}/steer",
    responses={**CONTROL_ERRORS, 400: {"description": "blank message"}},
)
def steer(run_id: OwnedRun, tenant: Tenant, api: Api, body: SteerBody) -> ControlReply:
    """Queue guidance; it reaches the model at the run's next turn boundary."""
    if not body.message.strip():
        raise HTTPException(400, "message must not be blank")
    verdict = api.client.store.steer(run_id, body.message, by=f"api:{tenant}")
    return _reply(api, run_id, "steer", verdict)


# -- the app ------------------------------------------------------------------------------
def create_app(settings: Settings | None = None, client: Client | None = None) -> FastAPI:
    settings = settings or get_settings()
    state = ApiState(client=client or Client(settings), tokens=settings.tenant_tokens())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The socket must outlast one XREAD BLOCK.
        state.events_redis = aioredis.Redis.from_url(
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
    app.include_router(router)
    app.add_api_route("/api/health", health, methods=["GET"], tags=["health"])
    return app


def health(api: Api) -> dict[str, Any]:
    """Liveness, without a token: the API answers and Redis answers."""
    try:
        redis_ok = bool(api.client.store.redis.ping())
    except Exception:
        redis_ok = False
    if not redis_ok:
        raise HTTPException(503, "Redis unreachable")
    return {"ok": True}


def serve(host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    import uvicorn

    uvicorn.run(
        create_app(), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=SHUTDOWN_GRACE_S
    )
