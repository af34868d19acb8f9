"""Rate limits per model and per tenant, shared by every worker through Redis.

Off unless ``TOOLOOP_RATE_LIMITS`` is set, a JSON object::

    {"models":  {"openai/gpt-4o": {"rpm": 500, "tpm": 200000}, "*": {"rpm": 1000}},
     "tenants": {"acme": {"rpm": 60}, "*": {"tpm": 100000}}}

``rpm`` is requests per minute, ``tpm`` tokens per minute (a request's prompt is
estimated before it is sent; the difference to what the provider reports is
settled after). ``"*"`` applies to every model (or tenant) without an entry of
its own, each with a bucket of its own. ``burst`` (optional) caps how much of a
limit may be spent at once; by default a whole minute's worth.

Each limit is a token bucket in Redis (``keys.rate_bucket``), refilled
continuously; one Lua script takes from all the buckets of a request at once or
from none, and says how long to wait. Time is Redis's (``TIME``), never the
caller's, as for leases: a host with a skewed clock, whose every call would look
like minutes of refill (or none), cannot drain or overfill a shared bucket.

A turn that would wait long is handed back to the queue with a countdown (see
``worker/turn.py``) rather than holding a worker slot; a retry or a fallback waits
in place, at most ``MAX_WAIT_IN_PLACE_S`` (longer, it too goes back to the queue): each
wait counts in the bound of the turn's model call (``worker/turn.py``, ``max_call_s``).
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import redis.asyncio as aioredis

from orchestrator.connections import connect_async
from orchestrator.keys import Keys
from orchestrator.settings import Settings

WAIT_IN_PLACE_S = 1.0  # a first attempt waiting longer than this defers the whole turn
MAX_WAIT_IN_PLACE_S = 30.0  # a retry or fallback waiting longer than this defers it too

# Redis's clock, in ms (scripts replicate their effects: TIME is allowed before writes)
_NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
"""

# KEYS: buckets. ARGV: per bucket: refill per ms, capacity, amount.
# Takes ``amount`` from every bucket, or from none: -> 0 | ms to wait until all have room.
TAKE = _NOW + """
local levels, wait = {}, 0
for i = 1, #KEYS do
  local rate, cap, amount = tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i])
  local st = redis.call('HMGET', KEYS[i], 'level', 'ts')
  local level = tonumber(st[1]) or cap
  local ts = tonumber(st[2]) or now
  level = math.min(cap, level + math.max(0, now - ts) * rate)
  levels[i] = level
  if level < amount then wait = math.max(wait, math.ceil((amount - level) / rate)) end
end
if wait > 0 then return wait end
for i = 1, #KEYS do
  local rate, cap, amount = tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i])
  redis.call('HSET', KEYS[i], 'level', levels[i] - amount, 'ts', now)
  redis.call('PEXPIRE', KEYS[i], math.ceil(cap / rate) + 60000)
end
return 0
"""

# Settles a tokens bucket after the reply: KEYS[1]; ARGV: refill per ms, capacity, delta
# (tokens used beyond the estimate; negative gives back). The level may go below zero.
SETTLE = _NOW + """
local rate, cap = tonumber(ARGV[1]), tonumber(ARGV[2])
local st = redis.call('HMGET', KEYS[1], 'level', 'ts')
local level = tonumber(st[1]) or cap
local ts = tonumber(st[2]) or now
level = math.min(cap, level + math.max(0, now - ts) * rate) - tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'level', math.min(cap, level), 'ts', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(cap / rate) + 60000)
return 0
"""


class RateLimited(Exception):
    """The call must wait ``wait_s`` for capacity: defer the turn rather than hold a slot."""

    def __init__(self, wait_s: float, scope: str) -> None:
        super().__init__(f"rate limit {scope}: capacity in {wait_s:.1f}s")
        self.wait_s = wait_s


@dataclass(frozen=True)
class Limit:
    per_minute: float
    burst: float

    @property
    def per_ms(self) -> float:
        return self.per_minute / 60_000


@dataclass(frozen=True)
class Bucket:
    scope: str  # e.g. "model:openai/gpt-4o:rpm"
    limit: Limit
    unit: str  # "requests" | "tokens"


class Limits:
    """The configured limits, and the buckets one request takes from."""

    def __init__(self, config: dict[str, Any]) -> None:
        unknown = set(config) - {"models", "tenants"}
        if unknown:
            raise ValueError(f"TOOLOOP_RATE_LIMITS: unknown sections {sorted(unknown)} (models, tenants)")
        self.models = {k: _limits(k, v) for k, v in (config.get("models") or {}).items()}
        self.tenants = {k: _limits(k, v) for k, v in (config.get("tenants") or {}).items()}

    def buckets(self, model: str, tenant: str) -> list[Bucket]:
        out = []
        for kind, name, table in (("model", model, self.models), ("tenant", tenant, self.tenants)):
            limits = table.get(name, table.get("*", {}))
            for unit_key, limit in sorted(limits.items()):
                unit = "requests" if unit_key == "rpm" else "tokens"
                out.append(Bucket(f"{kind}:{name}:{unit_key}", limit, unit))
        return out


def _limits(name: str, entry: Any) -> dict[str, Limit]:
    if not isinstance(entry, dict) or not set(entry) <= {"rpm", "tpm", "burst", "burst_tokens"}:
        raise ValueError(f"TOOLOOP_RATE_LIMITS: {name!r} takes rpm, tpm, burst, burst_tokens")
    out = {}
    for unit in ("rpm", "tpm"):
        if entry.get(unit):
            per_minute = float(entry[unit])
            burst = entry.get("burst" if unit == "rpm" else "burst_tokens") or per_minute
            out[unit] = Limit(per_minute, float(min(burst, per_minute)))
    return out


@lru_cache(maxsize=4)
def limits_from(raw: str) -> Limits | None:
    return Limits(json.loads(raw)) if raw.strip() else None


class Limiter:
    """Takes from the shared buckets, on the process's event loop (an asyncio Redis client)."""

    def __init__(self, settings: Settings, limits: Limits) -> None:
        self.settings, self.limits = settings, limits
        self.keys = Keys(settings.key_prefix)
        self._client: tuple[int, aioredis.Redis, Any, Any] | None = None

    def _redis(self) -> tuple[aioredis.Redis, Any, Any]:
        if self._client is None or self._client[0] != os.getpid():  # not across a fork
            client = connect_async(self.settings.redis_url, socket_timeout=10)  # Sentinel, Cluster too
            self._client = (os.getpid(), client, client.register_script(TAKE), client.register_script(SETTLE))
        return self._client[1:]

    async def take(self, model: str, tenant: str, tokens: int, may_defer: bool) -> None:
        """Wait for one request of ``tokens`` (estimated) on the model's and the tenant's
        buckets; ``RateLimited`` instead, when the wait is long (in all, past
        ``WAIT_IN_PLACE_S`` when ``may_defer``: a first attempt; past ``MAX_WAIT_IN_PLACE_S``
        for the others)."""
        buckets = self.limits.buckets(model, tenant)
        if not buckets:
            return
        _, take, _ = self._redis()
        keys = [self.keys.rate_bucket(b.scope) for b in buckets]
        limit, waited = (WAIT_IN_PLACE_S if may_defer else MAX_WAIT_IN_PLACE_S), 0.0
        while True:
            args: list[Any] = []
            for b in buckets:
                amount = 1 if b.unit == "requests" else min(tokens, b.limit.burst)
                args += [b.limit.per_ms, b.limit.burst, amount]
            wait_s = int(await take(keys=keys, args=args)) / 1000
            if wait_s <= 0:
                return
            if waited + wait_s > limit:  # in all: others may take what refilled meanwhile
                raise RateLimited(wait_s, ", ".join(b.scope for b in buckets))
            await asyncio.sleep(wait_s)
            waited += wait_s

    async def settle(self, model: str, tenant: str, estimated: int, used: int) -> None:
        """Charge the tokens buckets what the reply really used beyond the estimate."""
        _, _, settle = self._redis()
        for b in self.limits.buckets(model, tenant):
            if b.unit == "tokens" and used != estimated:
                delta = used - min(estimated, b.limit.burst)
                await settle(keys=[self.keys.rate_bucket(b.scope)],
                             args=[b.limit.per_ms, b.limit.burst, delta])  # fmt: skip


_limiters: dict[tuple[str, str, str], Limiter] = {}


def limiter_for(settings: Settings) -> Limiter | None:
    """This deployment's limiter, or None when no limit is configured."""
    limits = limits_from(settings.rate_limits)
    if limits is None:
        return None
    key = (settings.redis_url, settings.key_prefix, settings.rate_limits)
    if key not in _limiters:
        _limiters[key] = Limiter(settings, limits)
    return _limiters[key]
