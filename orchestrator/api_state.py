"""What the operator API's handlers share, and the run console it serves: the client, the
tokens, the event stream's connection (``orchestrator/api.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from orchestrator.client import Client


@dataclass
class ApiState:
    client: Client
    tokens: dict[bytes, str]  # SHA-256 of a bearer token -> tenant (no token kept in clear)
    events_redis: aioredis.Redis | None = None  # opened in the app's lifespan
    open_streams: int = 0  # event streams being served right now
    metrics: Any = None  # the Prometheus registry /metrics serves
