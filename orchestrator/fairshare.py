"""Tenant fair share: one tenant's burst never starves another.

Off unless configured; with nothing set, no run is gated and no script does any of this.

- ``TOOLOOP_TENANT_MAX_ACTIVE`` (``tenant=N,…``; ``*=N`` for every tenant without an
  entry) caps the runs of a tenant holding a slot (a turn or a tool call) at once, and
  ``TOOLOOP_MAX_ACTIVE`` (``N``) those of all tenants together. A run past a cap waits in
  its tenant's queue in Redis, in submit order: its first turn is not sent (no broker
  message, no worker slot), its status is ``queued`` with the reason ``waiting_share``.
- A slot frees when a run ends or parks (paused, every call of its turn waiting for a
  person's approval or for a child run). The freed slot goes to the waiting run of the
  tenant furthest below its weighted share (``TOOLOOP_TENANT_SHARES``, ``tenant=weight,…``,
  default 1) of the model tokens recorded over the last minute: a tenant alone gets every
  slot it may hold; an idle tenant's share goes to the others.
- A step sent (first turn, tool call, next turn) of a tenant below its weighted share, while
  another tenant holds a slot or waits, goes to the end of its queue workers take next
  (``ahead``; the Redis broker only: RabbitMQ's quorum queues keep their order).

The state lives under one hash tag (``{fair}``, keys.py), so ENQUEUE and PUMP below are each
atomic on Redis Cluster too; a run's own state (its gate: RunStore.mark_waiting /
open_gates) lives in its shard. The two are joined in an order a crash cannot break:
the run is written gated first, then put in the queue (ENQUEUE), then its gate is opened
(OPEN_GATE: its turn sent once) or marked waiting. A run gated but never queued is found
by the sweeper through its lease (RECOVER answers 'gated'), an admitted run whose gate
was not opened, a run that ended or parked without telling, by the fair-share sweep
(worker/fairshare.py): nothing is admitted twice (the queue's entry for a run moves from
waiting to active once), nothing is lost. See docs/fairshare.md.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrator.keys import SHARDS
from orchestrator.settings import Settings, parse_pairs

if TYPE_CHECKING:
    from orchestrator.store import Dispatch, RunStore

log = logging.getLogger(__name__)

WINDOW_MS = 60_000  # the token share is measured over this sliding window
BUCKET_MS = 10_000  # in buckets this long (scripts.PRELUDE: tenant_tokens)
TOKENS_CACHE_S = 0.2  # a process reads the shards' token counts at most this often
PUMP_MAX = 200  # runs one pump admits at most (the sweep pumps again)

# KEYS: runs, active, tenants, seq, the tenant's queue. ARGV: run id, tenant, its cap (-1:
# none), the total cap (-1: none) -> 'a' (holds a slot: open its gate) | 'w' (waits) | 'p'.
# A run seen before keeps its place: a retry (the sweeper's, after a crash) admits nothing twice.
ENQUEUE = """
local RUNS, ACTIVE, TENANTS, SEQ, WAIT = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local run, tenant, cap, total = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local cur = redis.call('HGET', RUNS, run)
if cur then return string.sub(cur, 1, 1) end
local n = tonumber(redis.call('HGET', ACTIVE, tenant)) or 0
local free = redis.call('ZCARD', WAIT) == 0 and (cap < 0 or n < cap)
if free and total >= 0 then
  local all = 0
  for _, v in ipairs(redis.call('HVALS', ACTIVE)) do all = all + tonumber(v) end
  free = all < total
end
if free then
  redis.call('HSET', RUNS, run, 'a|' .. tenant)
  redis.call('HINCRBY', ACTIVE, tenant, 1)
  return 'a'
end
redis.call('ZADD', WAIT, redis.call('INCR', SEQ), run)
redis.call('HSET', RUNS, run, 'w|' .. tenant)
redis.call('SADD', TENANTS, tenant)
return 'w'
"""

# One run's move ('end': it ended; 'park': it gave its slot up; 'resume': it takes it back
# at once, over its cap if need be: a person's resume is not queued), then the admissions
# of waiting runs while slots are free: each goes to the tenant with the lowest tokens /
# weight, ties to the run submitted first. A tenant's tokens: those its runs recorded
# over the window, plus a reply's worth (its runs' average) for each run holding a slot:
# the reply each is about to bill. Without that term, a tenant whose runs are in flight
# looks as cheap as before them, and takes every slot until their replies are billed.
# KEYS: runs, active, tenants, the queue of each tenant named in ARGV.
# ARGV: run id ('' none), how, total cap (-1 none), most to admit, then per tenant: name,
# weight, cap (-1 none), tokens over the window, tokens of one of its replies (average)
# -> {'need', tenant} (that tenant's queue is needed: call again with it)
#  | {what the run was ('a'|'p'|'w'|''), {admitted run ids}, {tenants with runs waiting}}
PUMP = """
local RUNS, ACTIVE, TENANTS = KEYS[1], KEYS[2], KEYS[3]
local run, how, total, most = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local list, by = {}, {}
for i = 5, #ARGV, 5 do
  local e = {name = ARGV[i], weight = tonumber(ARGV[i + 1]), cap = tonumber(ARGV[i + 2]),
             tokens = tonumber(ARGV[i + 3]), reply = tonumber(ARGV[i + 4]),
             k = 4 + #list}  -- KEYS[e.k]: its queue
  list[#list + 1] = e
  by[e.name] = e
end
local function count(tenant, delta)
  if redis.call('HINCRBY', ACTIVE, tenant, delta) <= 0 then redis.call('HDEL', ACTIVE, tenant) end
end
local was = ''
local cur = run ~= '' and redis.call('HGET', RUNS, run)
if cur then
  was = string.sub(cur, 1, 1)
  local tenant = string.sub(cur, 3)
  if was == 'w' and how == 'end' then
    local e = by[tenant]
    if not e then return {'need', tenant} end
    redis.call('ZREM', KEYS[e.k], run)
    redis.call('HDEL', RUNS, run)
    if redis.call('ZCARD', KEYS[e.k]) == 0 then redis.call('SREM', TENANTS, tenant) end
  elseif was == 'a' and how ~= 'resume' then
    count(tenant, -1)
    if how == 'end' then redis.call('HDEL', RUNS, run)
    else redis.call('HSET', RUNS, run, 'p|' .. tenant) end
  elseif was == 'p' and how == 'end' then
    redis.call('HDEL', RUNS, run)
  elseif was == 'p' and how == 'resume' then
    count(tenant, 1)
    redis.call('HSET', RUNS, run, 'a|' .. tenant)
  end
end
local all = 0
for _, v in ipairs(redis.call('HVALS', ACTIVE)) do all = all + tonumber(v) end
for _, e in ipairs(list) do e.n = tonumber(redis.call('HGET', ACTIVE, e.name)) or 0 end
local admitted = {}
while #admitted < most and (total < 0 or all < total) do
  local best, best_score, best_seq
  for _, e in ipairs(list) do
    if e.cap < 0 or e.n < e.cap then
      local head = redis.call('ZRANGE', KEYS[e.k], 0, 0, 'WITHSCORES')
      if head[1] then
        local score, seq = (e.tokens + e.n * e.reply) / e.weight, tonumber(head[2])
        if not best or score < best_score or (score == best_score and seq < best_seq) then
          best, best_score, best_seq = e, score, seq
        end
      end
    end
  end
  if not best then break end
  local id = redis.call('ZPOPMIN', KEYS[best.k])[1]
  redis.call('HSET', RUNS, id, 'a|' .. best.name)
  count(best.name, 1)
  best.n, all = best.n + 1, all + 1
  if redis.call('ZCARD', KEYS[best.k]) == 0 then redis.call('SREM', TENANTS, best.name) end
  admitted[#admitted + 1] = id
end
return {was, admitted, redis.call('SMEMBERS', TENANTS)}
"""


@dataclass(frozen=True)
class Policy:
    weights: dict[str, float]
    caps: dict[str, float]  # "*": every tenant without an entry of its own
    total: int | None

    @classmethod
    def from_settings(cls, settings: Settings) -> Policy | None:
        """None when nothing is configured (fair share costs nothing then)."""
        if not (settings.tenant_shares or settings.tenant_max_active or settings.max_active):
            return None
        return cls(parse_pairs("TOOLOOP_TENANT_SHARES", settings.tenant_shares, integer=False),
                   parse_pairs("TOOLOOP_TENANT_MAX_ACTIVE", settings.tenant_max_active, integer=True),
                   settings.max_active)  # fmt: skip

    @property
    def gating(self) -> bool:
        """Runs wait only where a cap is set; weights alone just count tokens."""
        return bool(self.caps) or self.total is not None

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.weights.get("*", 1.0))

    def cap(self, tenant: str) -> int:
        """-1: no cap of its own."""
        return int(self.caps.get(tenant, self.caps.get("*", -1)))


@dataclass
class Standing:
    """The tenants as one process last read them (FairShare.standing)."""

    active: dict[str, int]  # tenant -> runs holding a slot
    waiting: set[str]  # tenants with runs waiting
    minute: dict[str, int]  # tenant -> model tokens recorded over the last minute
    reply: dict[str, float]  # tenant -> tokens of one of its replies (its average)


@dataclass
class TenantShare:
    """One tenant as `tooloop doctor`, the metrics and the console show it."""

    tenant: str
    weight: float
    cap: int | None
    active: int
    waiting: int
    tokens_minute: int  # model tokens recorded over the last minute
    tokens_total: int  # since its first run under fair share (kept as long as the keys)
    share: float = 0.0  # its part of all tenants' tokens over the last minute (0..1)


class FairShare:
    """The admission of one deployment (one store)."""

    def __init__(self, store: RunStore, policy: Policy) -> None:
        self.store, self.policy, self.keys = store, policy, store.keys
        self._enqueue = store.redis.register_script(ENQUEUE)
        self._pump = store.redis.register_script(PUMP)
        self._waiting_tenants: set[str] = set()  # as the last pump saw them
        self._standing: tuple[float, Standing] = (-TOKENS_CACHE_S, Standing({}, set(), {}, {}))
        self._celery: Any = None
        self._broker: Any = _UNSET

    @property
    def mode(self) -> str:
        """What a new run is written with (RunStore.create's ``fair``)."""
        return "gate" if self.policy.gating else "track"

    # -- a new run ------------------------------------------------------------------
    def submitted(self, run_id: str, tenant: str, celery_app: Any = None) -> bool:
        """Queue a run written gated: True when it holds a slot now (its turn is sent)."""
        state = self.enqueue(run_id, tenant)
        if state == "w":  # 'open': admitted meanwhile, and sent
            return self.store.mark_waiting(run_id) == "open"
        if state == "a":
            self.open([run_id], celery_app, tenant)
        return state == "a"

    def enqueue(self, run_id: str, tenant: str) -> str:
        """ENQUEUE: 'a' (holds a slot), 'w' (waits) or 'p' (parked); a run queued before keeps
        its place and its slot."""
        k = self.keys
        keys = [k.fair_runs(), k.fair_active(), k.fair_tenants(), k.fair_seq(), k.fair_waiting(tenant)]
        return _s(self._enqueue(keys=keys, args=[run_id, tenant, self.policy.cap(tenant), self._total()]))

    # -- slots ----------------------------------------------------------------------
    def move(self, run_id: str, how: str, tenant: str | None = None) -> list[str]:
        """``run_id`` ended ('end'), parked ('park') or resumed ('resume'), then admit what
        the freed slots allow ('' run: only admit): the runs admitted, gates still closed."""
        tenants = set(self._waiting_tenants) | ({tenant} if tenant else set())
        for _ in range(4):
            out = self._call_pump(run_id, how, sorted(tenants))
            if _s(out[0]) == "need":
                tenants.add(_s(out[1]))
                continue
            self._waiting_tenants = {_s(t) for t in out[2]}
            admitted = [_s(r) for r in out[1]]
            fresh = self._waiting_tenants - tenants  # a tenant that began waiting meanwhile
            if fresh and not admitted:
                run_id, how, tenants = "", "", tenants | fresh
                continue
            return admitted
        return []

    def pump(self) -> list[str]:
        return self.move("", "")

    def open(self, run_ids: list[str], celery_app: Any = None, tenant: str | None = None) -> int:
        """Open the gates of admitted runs and send their turns (of ``tenant``'s runs: ahead
        of the others' if it is below its share); a run that ended while it waited gives its
        slot back at once (to the next). Turns sent."""
        sent = 0
        while run_ids:
            gone: list[str] = []
            for run_id, result in zip(run_ids, self.store.open_gates(run_ids), strict=True):
                if isinstance(result, Exception):
                    log.warning("run %s: admitted, gate not opened (%s); the sweep opens it", run_id, result)
                elif isinstance(result, str):
                    if result in ("ended", "missing"):
                        gone.append(run_id)
                else:
                    self._send(result, celery_app, tenant)
                    sent += 1
            run_ids, tenant = [r for g in gone for r in self.move(g, "end")], None
        return sent

    def _send(self, dispatch: Dispatch, celery_app: Any, tenant: str | None) -> None:
        from orchestrator.dispatch import send

        try:
            send(dispatch, celery_app or self.celery)
        except Exception:  # the step's message is missing: the sweeper sends it (RESEND)
            log.warning("run %s: its turn was not sent; the sweeper will", dispatch.run_id, exc_info=True)
            return
        if tenant is not None:
            ahead(self.store, tenant, dispatch)

    @property
    def celery(self) -> Any:
        if self._celery is None:
            from orchestrator.dispatch import app_for

            self._celery = app_for(self.store.settings)
        return self._celery

    def _total(self) -> int:
        return -1 if self.policy.total is None else self.policy.total

    def _call_pump(self, run_id: str, how: str, tenants: list[str]) -> Any:
        k = self.keys
        tokens, reply = self.tokens_minute() if len(tenants) > 1 else ({}, {})
        usual = max(1.0, sum(reply.values()) / len(reply)) if reply else 1.0  # a tenant with none yet
        args: list[Any] = [run_id, how, self._total(), PUMP_MAX]
        for tenant in tenants:
            args += [tenant, self.policy.weight(tenant), self.policy.cap(tenant), tokens.get(tenant, 0),
                     reply.get(tenant, usual)]  # fmt: skip
        keys = [k.fair_runs(), k.fair_active(), k.fair_tenants(), *(k.fair_waiting(t) for t in tenants)]
        return self._pump(keys=keys, args=args)

    # -- a step ahead of the others ---------------------------------------------------
    def below_share(self, tenant: str) -> bool:
        """Whether ``tenant`` is below its weighted share while another tenant holds a slot
        or waits: its tokens over the window plus a reply's worth per run holding a slot
        (PUMP's measure), over its weight, under the same sum of all those tenants over the
        sum of their weights. Read at most every TOKENS_CACHE_S (``standing``)."""
        now = self.standing()
        tenants = {t for t, n in now.active.items() if n > 0} | now.waiting | {tenant}
        if len(tenants) < 2:
            return False
        usual = max(1.0, sum(now.reply.values()) / len(now.reply)) if now.reply else 1.0

        def spent(t: str) -> float:
            return now.minute.get(t, 0) + now.active.get(t, 0) * now.reply.get(t, usual)

        everyone = sum(spent(t) for t in tenants) / sum(self.policy.weight(t) for t in tenants)
        return spent(tenant) / self.policy.weight(tenant) < everyone

    def ahead(self, tenant: str, dispatch: Dispatch) -> bool:
        """A step of ``tenant`` just sent: moved to the end of its queue that workers take next
        when its tenant is below its share (``below_share``). Only on a Redis broker (JUMP):
        RabbitMQ's quorum queues have no priorities (3.10); there the admission alone applies.
        A round trip when it moves; none when not."""
        from orchestrator.dispatch import message_of

        broker = self.broker
        if broker is None or not self.below_share(tenant):
            return False
        queue, task_id = message_of(self.keys, dispatch)
        return self.store.jump(broker, self.keys.broker_prefix + queue, task_id)

    @property
    def broker(self) -> Any:
        """The broker's Redis client (the store's when they are one), or None (RabbitMQ)."""
        if self._broker is _UNSET:
            from orchestrator.broker import redis_of

            self._broker = redis_of(self.store)
        return self._broker

    # -- tokens -----------------------------------------------------------------------
    def standing(self) -> Standing:
        """The slots held, the tenants waiting and the tokens (``read_tokens``), in one round
        trip, read at most every TOKENS_CACHE_S."""
        if time.monotonic() - self._standing[0] < TOKENS_CACHE_S:
            return self._standing[1]
        pipe = self.store.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.fair_active())
        pipe.smembers(self.keys.fair_tenants())
        answers = self._ask_tokens(pipe).execute()
        minute, total, replies = self._count_tokens(answers[2:])
        now = Standing({_s(t): int(n) for t, n in answers[0].items()}, {_s(t) for t in answers[1]}, minute,
                       {t: total[t] / n for t, n in replies.items() if n and t in total})  # fmt: skip
        self._standing = (time.monotonic(), now)
        return now

    def tokens_minute(self) -> tuple[dict[str, int], dict[str, float]]:
        """Tenant -> model tokens recorded over the last minute, and -> tokens of one of its
        replies (its average), summed over the shards (read at most every TOKENS_CACHE_S)."""
        now = self.standing()
        return now.minute, now.reply

    def read_tokens(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """(tokens over the last minute, tokens in all, replies in all) per tenant. The window
        is the last six 10 s buckets and the current one's part, weighted by how much of the
        oldest bucket still lies inside the minute."""
        return self._count_tokens(self._ask_tokens(self.store.redis.pipeline(transaction=False)).execute())

    def _ask_tokens(self, pipe: Any) -> Any:
        pipe.time()
        for shard in range(SHARDS):
            pipe.hgetall(self.keys.tenant_tokens(shard))
        return pipe

    def _count_tokens(self, answers: list[Any]) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        seconds, micros = answers[0]
        now = seconds * 1000 + micros // 1000
        newest = now // BUCKET_MS
        oldest_part = 1.0 - (now % BUCKET_MS) / BUCKET_MS  # of bucket newest-6
        minute: dict[str, float] = {}
        total: dict[str, int] = {}
        replies: dict[str, int] = {}
        for fields in answers[1:]:
            for raw_field, raw_value in fields.items():
                tenant, _, bucket = _s(raw_field).rpartition("|")
                value = int(raw_value)
                if bucket in ("total", "replies"):
                    into = total if bucket == "total" else replies
                    into[tenant] = into.get(tenant, 0) + value
                    continue
                age = newest - int(bucket)
                weight = 1.0 if age < 6 else oldest_part if age == 6 else 0.0
                minute[tenant] = minute.get(tenant, 0.0) + value * weight
        return {t: round(v) for t, v in minute.items()}, total, replies

    # -- what is shown ----------------------------------------------------------------
    def shares(self) -> list[TenantShare]:
        """Every tenant with a setting, a slot, a run waiting or tokens counted."""
        k, redis = self.keys, self.store.redis
        active = {_s(t): int(n) for t, n in redis.hgetall(k.fair_active()).items()}
        minute, total, _ = self.read_tokens()
        names = (set(active) | {_s(t) for t in redis.smembers(k.fair_tenants())} | set(minute) | set(total)
                 | set(self.policy.weights) | set(self.policy.caps)) - {"*"}  # fmt: skip
        pipe = redis.pipeline(transaction=False)
        for tenant in sorted(names):
            pipe.zcard(k.fair_waiting(tenant))
        waiting = dict(zip(sorted(names), pipe.execute(), strict=True))
        spent = sum(minute.values())
        return [TenantShare(t, self.policy.weight(t), None if self.policy.cap(t) < 0 else self.policy.cap(t),
                            active.get(t, 0), int(waiting[t]), minute.get(t, 0), total.get(t, 0),
                            minute.get(t, 0) / spent if spent else 0.0)
                for t in sorted(names)]  # fmt: skip


def of(store: RunStore) -> FairShare | None:
    """The store's fair share, or None when none is configured (nothing to do then)."""
    cached = store.__dict__.get("_fairshare", _UNSET)
    if cached is _UNSET:
        policy = Policy.from_settings(store.settings)
        cached = store.__dict__["_fairshare"] = FairShare(store, policy) if policy else None
    return cached


def moved(store: RunStore, run_id: str, how: str, celery_app: Any = None) -> None:
    """``run_id`` ended, parked or resumed: its slot moves, waiting runs are admitted. Never
    fails its caller: the fair-share sweep (worker/fairshare.py) covers what is missed."""
    fair = of(store)
    if fair is None or not fair.policy.gating:
        return
    try:
        fair.open(fair.move(run_id, how), celery_app)
    except Exception:
        log.warning("run %s: fair share not told it %sed; the sweep will", run_id, how, exc_info=True)


def ahead(store: RunStore, tenant: str, dispatch: Dispatch) -> bool:
    """A step of ``tenant`` just sent: taken next if its tenant is below its weighted share
    (FairShare.ahead). Nothing, and no round trip, without a cap configured; never fails
    its caller (the step is sent: it waits its turn in the queue)."""
    fair = of(store)
    if fair is None or not fair.policy.gating:
        return False
    try:
        return fair.ahead(tenant, dispatch)
    except Exception:
        log.warning("run %s: its %s not put ahead", dispatch.run_id, dispatch.step, exc_info=True)
        return False


_UNSET = object()


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def queue_gated(store: RunStore, run_id: str, celery_app: Any = None) -> None:
    """A run written gated whose place in its tenant's queue was never confirmed: queue it
    (ENQUEUE keeps a place it already has, so this admits nothing twice)."""
    fair = of(store)
    tenant = _s(store.redis.hget(store.keys.run(run_id), "tenant") or "default")
    if fair is None or not fair.policy.gating:  # fair share was turned off: let it go
        fair = FairShare(store, Policy({}, {}, None))
        fair.open([run_id], celery_app)
        return
    log.warning("run %s: not in its tenant's queue yet; queued by the sweeper", run_id)
    fair.submitted(run_id, tenant, celery_app)
