"""Human approval of tool calls: the state in Redis, each change one Lua call.

A call gated by approval (``@tool(approval=True)``, or a spec's ``approval: [names]``)
reaches the tool task like any call; the task asks ``park`` first:

- no decision yet: the call is **parked**. Its approval record (hash ``approvals``,
  field ``<iteration>.<index>``) says pending; its call state becomes ``q|<approval
  deadline>`` (dispatched, not started: no lease runs and no heartbeat is owed); an
  ``approval`` event carries its name and scrubbed arguments. The task returns: no
  worker slot is held while a person decides.
- ``decide`` (``tooloop approve|deny``, ``RunHandle.approve|deny``, the API), addressed by
  the call's id in the run (unique: a call id the model repeated was rewritten when the
  reply was recorded, see RECORD_REPLY in orchestrator/scripts.py), records the
  decision once (a second decision answers ``already``: fenced like every directive)
  and hands back the call's payload to dispatch again; the call state's deadline
  becomes a lease deadline, so a dispatch lost with its sender is re-sent by the sweeper.
- the call comes back to the tool task: approved, it runs; denied, it is recorded as
  a failed call with the reason, fed back to the model.
- no decision by the deadline (``approval_timeout_s``, default 24 h): when the sweeper
  re-sends the parked call at its deadline, ``park`` denies it ("approval timed out").

Everything lives in Redis, so decisions survive worker restarts; the ``approvals`` hash
expires with the run's other keys. These scripts name their own keys (the run's hash
tag, and DECIDE its shard's lease index, which shares it): they do not depend on the
step scripts' layout. Time is Redis's (``TIME``), never the caller's, as in
orchestrator/scripts.py: a host with a skewed clock cannot shift a deadline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrator.bounds import REASON_MAX_CHARS, RECORD_INPUTS_MAX_BYTES, bound_value, refuse_long
from orchestrator.keys import shard_of
from orchestrator.scrub import scrub_value

if TYPE_CHECKING:
    from orchestrator.store import RunStore

DEFAULT_TIMEOUT_S = 24 * 3600

_COMMON = """
local RUN, CSTATE, CARGS, EVENTS, APPROVALS, CALLIDS =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local clock = redis.call('TIME')
local NOW = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local function ended(status)
  return status == 'completed' or status == 'failed' or status == 'aborted'
end
local function event(maxlen, now, ...)
  redis.call('XADD', EVENTS, 'MAXLEN', '~', maxlen, '*', 'type', 'approval', 'ts', now, ...)
end
-- A call state ``kind|deadline|attempts|gen|taken|owner|error`` (orchestrator/scripts.py)
-- made ``q`` (dispatched, not started) with a new deadline, its other fields kept; a
-- bumped generation when a new message is to be sent for it. Returns the state's generation.
local function requeue(key, raw, deadline, bump)
  local k, d, a, g, t, o, e =
    string.match(raw, '^(%a)|(%-?%d+)|(%d+)|(%d+)|(%d+)|([^|]*)|(.*)$')
  if not k then a, g, t, o, e = '0', '0', '0', '', '' end
  g = tonumber(g) + (bump and 1 or 0)
  redis.call('HSET', CSTATE, key, table.concat({'q', deadline, a, string.format('%d', g), t, o, e}, '|'))
  return g
end
local function decided(key, a, decision, reason, by, now, maxlen)
  a.state, a.reason, a.by, a.decided_at = decision, reason, by, now
  redis.call('HSET', APPROVALS, key, cjson.encode(a))
  redis.call('HINCRBY', RUN, 'approvals_pending', -1)
  event(maxlen, now, 'iteration', a.iteration, 'call_id', a.call_id, 'tool', a.tool,
    'decision', decision, 'by', by, 'reason', reason)
end
"""

# ARGV: key, iteration, approval timeout (ms), maxlen, call_id, tool, arguments (scrubbed),
#   timeout text
# -> {'parked'} | {'pending'} | {'approved'} | {'denied', reason} | {'ended'|'stale'|'done'}
PARK = _COMMON + """
local st = redis.call('HMGET', RUN, 'status', 'iteration', 'phase')
if not st[1] or ended(st[1]) then return {'ended'} end
if tonumber(st[2]) ~= tonumber(ARGV[2]) or st[3] ~= 'tools' then return {'stale'} end
local state = redis.call('HGET', CSTATE, ARGV[1])
if not state then return {'stale'} end
if state == 'd' then return {'done'} end
local now, maxlen = NOW, ARGV[4]
local deadline = NOW + tonumber(ARGV[3])
local raw = redis.call('HGET', APPROVALS, ARGV[1])
if raw then
  local a = cjson.decode(raw)
  if a.state == 'approved' then return {'approved'} end
  if a.state == 'denied' then return {'denied', a.reason} end
  if now >= a.deadline then
    decided(ARGV[1], a, 'denied', ARGV[8], 'timeout', now, maxlen)
    return {'denied', ARGV[8]}
  end
  requeue(ARGV[1], state, a.deadline, false)  -- parked again (a re-send)
  return {'pending'}
end
local a = {state = 'pending', call_id = ARGV[5], tool = ARGV[6], iteration = tonumber(ARGV[2]),
  requested_at = now, deadline = deadline}
redis.call('HSET', APPROVALS, ARGV[1], cjson.encode(a))
requeue(ARGV[1], state, deadline, false)
redis.call('HINCRBY', RUN, 'approvals_pending', 1)
event(maxlen, now, 'iteration', ARGV[2], 'call_id', ARGV[5], 'tool', ARGV[6],
  'decision', 'pending', 'arguments', ARGV[7], 'deadline', deadline)
return {'parked'}
"""

# KEYS: + the shard's lease index (same hash tag). ARGV: call_id, decision
#   ('approved'|'denied'), reason, by, lease (ms), maxlen, run id
# -> {'ok', payload, generation} | {'already', state} | {'unknown'} | {'ended'} | {'missing'}
DECIDE = _COMMON + """
local LEASES = KEYS[7]
local status = redis.call('HGET', RUN, 'status')
if not status then return {'missing'} end
if ended(status) then return {'ended'} end
-- the call's id in the run (unique: RECORD_REPLY); 'id:' entries: parked before call ids were
local key = redis.call('HGET', CALLIDS, ARGV[1]) or redis.call('HGET', APPROVALS, 'id:' .. ARGV[1])
if not key then return {'unknown'} end
local raw = redis.call('HGET', APPROVALS, key)
if not raw then return {'unknown'} end  -- a call that is not (or not yet) waiting for a person
local a = cjson.decode(raw)
if a.state ~= 'pending' then return {'already', a.state} end
decided(key, a, ARGV[2], ARGV[3], ARGV[4], NOW, ARGV[6])
local state = redis.call('HGET', CSTATE, key)
if not state or state == 'd' then return {'ok', ''} end
local lease = NOW + tonumber(ARGV[5])
local gen = requeue(key, state, lease, true)
-- in the same step: a dispatch lost with its sender is re-sent by the sweeper
redis.call('ZADD', LEASES, 'LT', lease, ARGV[7])
return {'ok', redis.call('HGET', CARGS, key) or '', gen}
"""


@dataclass
class Gate:
    """What ``park`` says about one delivery of a gated call."""

    verdict: str  # parked | pending | approved | denied | ended | stale | done
    reason: str = ""


def _keys(store: RunStore, run_id: str) -> list[str]:
    k = store.keys
    return [k.run(run_id), k.call_state(run_id), k.call_args(run_id), k.events(run_id), k.approvals(run_id),
            k.call_ids(run_id)]  # fmt: skip


def _script(store: RunStore, name: str) -> Any:
    # registered once per store (its Redis client), beside the store's own step scripts
    cache = store.__dict__.setdefault("_approval_scripts", {})
    if name not in cache:
        cache[name] = store.redis.register_script(PARK if name == "PARK" else DECIDE)
    return cache[name]


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def park(store: RunStore, payload: dict[str, Any], arguments: Any) -> Gate:
    """The first look of the tool task at a gated call (see the module docstring)."""
    timeout_s = float(payload.get("approval_timeout_s") or DEFAULT_TIMEOUT_S)
    shown = json.dumps(bound_value(scrub_value(arguments), RECORD_INPUTS_MAX_BYTES))  # as in the record
    out = _script(store, "PARK")(keys=_keys(store, payload["run_id"]), args=[
        payload["key"], payload["iteration"], int(timeout_s * 1000), store.settings.events_maxlen,
        payload["call_id"], payload["tool"], shown, f"approval timed out after {timeout_s:g}s",
    ])  # fmt: skip
    return Gate(_s(out[0]), _s(out[1]) if len(out) > 1 else "")


def decide(store: RunStore, run_id: str, call_id: str, approved: bool, reason: str = "",
           by: str = "operator") -> tuple[str, dict[str, Any] | None, int]:  # fmt: skip
    """Record a decision: ('ok', payload to dispatch, its message generation), or
    ('already'|'unknown'|'ended'|'missing', None, 0). A reason over REASON_MAX_CHARS is
    refused (``TooLong``) before anything is written."""
    decision = "approved" if approved else "denied"
    reason = reason or ("approved" if approved else "denied by a person")
    refuse_long("reason", reason, REASON_MAX_CHARS)
    leases = store.keys.leases(shard_of(run_id))  # the run's hash tag (orchestrator/keys.py)
    out = _script(store, "DECIDE")(keys=[*_keys(store, run_id), leases], args=[
        call_id, decision, reason, by, int(store.settings.lease_s * 1000),
        store.settings.events_maxlen, run_id])  # fmt: skip
    verdict = _s(out[0])
    if verdict != "ok":
        return verdict, None, 0
    raw = _s(out[1])
    return "ok", (json.loads(raw) if raw else None), int(out[2]) if len(out) > 2 else 0


def pending(store: RunStore, run_id: str) -> list[dict[str, Any]]:
    """The run's calls waiting for a decision, oldest first."""
    raw = store.redis.hgetall(store.keys.approvals(run_id))
    items = [json.loads(v) for k, v in raw.items() if not _s(k).startswith("id:")]
    return sorted((a for a in items if a["state"] == "pending"), key=lambda a: a["requested_at"])


def waiting_runs(store: RunStore, scan: int = 1000, tenant: str | None = None) -> list[dict[str, str]]:
    """Recent runs with at least one call waiting for a person (``tooloop list --pending``)."""
    ids = [row["run_id"] for row in store.list_runs(scan, tenant)]  # merged over the shards
    pipe = store.redis.pipeline(transaction=False)
    for run_id in ids:
        pipe.hget(store.keys.run(run_id), "approvals_pending")
    waiting = {run_id for run_id, n in zip(ids, pipe.execute(), strict=True) if n and int(n) > 0}
    live = ("queued", "running", "paused")
    return [r for r in store.list_runs(scan, tenant) if r["run_id"] in waiting and r["status"] in live]
