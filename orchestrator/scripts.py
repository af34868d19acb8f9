"""Lua scripts: each state change of a run is one atomic round trip.

Every script receives the same KEYS: the run's own keys (``Keys.all_for_run``), then
its shard's lease index, run index, expiry index and tenant tokens (``Keys.shard_keys``). They all
share the shard's hash tag, so each script touches one slot (Redis Cluster-safe).
ARGV starts with the same five values (run id, lease ms, events cap, retention s,
attempts per step), read by ``PRELUDE``; a script's own arguments follow (``arg(i)``).

Time is Redis's (``TIME``), never the caller's: a host with a skewed clock cannot
shorten or stretch a lease.

Owners and fencing. Each claim (a turn, a call's start) carries a fresh owner token.
Heartbeats, records, failures and hand-backs act only for the step's latest owner: a
holder whose step was taken over records nothing. A holder whose lease lapsed but
whom nobody replaced yet may carry on (its heartbeat re-takes the step).

Dispatch generations. Every message of a step carries the step's generation; each
re-send increments it, and a delivery of an older one is dropped. The sweeper
re-sends a step only when its message is known consumed (its holder was lost, or it
failed) or, for a message never taken, once it is found missing from the queue.

Attempts. Each claim counts one attempt of its step; past ``attempts per step`` the
step is recorded failed with its last error and the run ends on ``error``.

Call states (hash CSTATE, one field per call ``<iteration>.<index>`` of the current
turn), ``kind|deadline|attempts|gen|taken|owner|error``:
  ``q``  dispatched, not started; deadline = when to check on its message
  ``s``  started under a lease its owner heartbeats
  ``x``  started, then its lease lapsed and it was re-sent: re-run only if idempotent
  ``d``  recorded (the whole value)
``taken`` is the generation of the last message a worker took for the call.

Turn fields on the run hash: ``turn_gen``, ``turn_taken``, ``turn_claimed`` (1 while a
holder's lease is live), ``turn_owner``, ``turn_deadline``, ``turn_attempts``,
``turn_error``. Billing: each claim's owner is kept in CLAIMS until its reply is billed,
so any reply (recorded, discarded, or of a failed attempt) is counted once.
"""

PRELUDE = """
local RUN, MSGS, CALLS, CSTATE, CARGS, TMSGS, STEER, EVENTS, SUP, CLAIMS =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
-- KEYS[11]: the approvals hash (orchestrator/approvals.py); KEYS[12]: the run's call ids;
-- KEYS[13]: the run's journal (orchestrator/journal.py)
local CALLIDS, JOURNAL = KEYS[12], KEYS[13]
local NRUN = 13  -- the run's own keys, expired with it
local LEASES, RUNS, EXPIRY, TOKENS = KEYS[NRUN + 1], KEYS[NRUN + 2], KEYS[NRUN + 3], KEYS[NRUN + 4]
local EXTRA = NRUN + 5  -- a script's own KEYS (after the run's and its shard's) start here
local RUN_ID, LEASE, MAXLEN, TTL, CAP =
  ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local function arg(i) return ARGV[5 + i] end
-- A step's attempts: CAP once an attempt of it raised (a poison step); while its holders
-- were only lost (a worker killed, frozen past its lease) LOST_CAPS times that: a worker's
-- death says little about the step, and under kills every few seconds a healthy step was
-- lost with three holders in a row (bench/chaos.py). A step that kills its worker each
-- time is still stopped, a few workers later.
local LOST_CAPS = 3
local function cap_of(err) return (err and err ~= '') and CAP or CAP * LOST_CAPS end
local clock = redis.call('TIME')
local NOW = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local function ended(status)
  return status == 'completed' or status == 'failed' or status == 'aborted'
end

local function event(kind, ...)
  redis.call('XADD', EVENTS, 'MAXLEN', '~', MAXLEN, '*', 'type', kind, 'ts', NOW, ...)
end

local function expire_all()
  for i = 1, NRUN do redis.call('EXPIRE', KEYS[i], TTL) end
end

local function int(x) return string.format('%d', x) end

-- A call's state, parsed; states written before owners existed read as attempts 0.
local function parse(raw)
  if not raw then return nil end
  if raw == 'd' then return {kind = 'd'} end
  local k, d, a, g, t, o, e =
    string.match(raw, '^(%a)|(%-?%d+)|(%d+)|(%d+)|(%d+)|([^|]*)|(.*)$')
  if not k then
    return {kind = string.sub(raw, 1, 1), deadline = tonumber(string.sub(raw, 3)) or 0,
            attempts = 0, gen = 0, taken = 0, owner = '', err = ''}
  end
  return {kind = k, deadline = tonumber(d), attempts = tonumber(a), gen = tonumber(g),
          taken = tonumber(t), owner = o, err = e}
end

local function put(key, c)
  redis.call('HSET', CSTATE, key, table.concat({c.kind, int(c.deadline), int(c.attempts),
    int(c.gen), int(c.taken), c.owner, c.err}, '|'))
end

-- When the sweeper must look at this run next: its earliest lease or dispatch
-- deadline (or its pause deadline). Every script that moves a deadline calls this.
local function next_look()
  local st = redis.call('HMGET', RUN, 'status', 'phase', 'turn_deadline', 'pause_deadline', 'gate')
  if not st[1] or ended(st[1]) then redis.call('ZREM', LEASES, RUN_ID) return end
  local paused = st[1] == 'paused'
  -- waiting in its tenant's queue (orchestrator/fairshare.py): that queue holds it, not the
  -- leases; until its place there is confirmed (gate 'new') it is looked at like a turn
  if st[5] == 'wait' and not paused then redis.call('ZREM', LEASES, RUN_ID) return end
  local t = paused and tonumber(st[4]) or nil
  local function consider(d) if d and (not t or d < t) then t = d end end
  if st[2] == 'turn' and not paused then consider(tonumber(st[3])) end
  if st[2] == 'tools' then
    for _, raw in ipairs(redis.call('HVALS', CSTATE)) do
      local c = parse(raw)
      if c.kind ~= 'd' and not (paused and c.kind ~= 's') then consider(c.deadline) end
    end
  end
  redis.call('ZADD', LEASES, t or (NOW + LEASE), RUN_ID)
end

-- Child runs (orchestrator/children.py). A child lives in its parent's shard, so a script
-- reaches its parent's and children's keys: their id in place of its own (keys.py). A
-- child's hash names its ancestors (``ancestors``, parent first) and the parent's call it
-- answers (``parent_key``); a parent's names its children (``children``, JSON).
local RUN_BASE = string.sub(RUN, 1, #RUN - #RUN_ID - 6)  -- '<prefix>:{s<n>}:run:'
local function key_of(id, i)  -- KEYS[i] of the run ``id``
  return RUN_BASE .. id .. string.sub(KEYS[i], #RUN_BASE + #RUN_ID + 1)
end

-- The run ``id`` ended: its parent's call waiting for it is due within a lease (whoever
-- ended it records the call now: worker/children.py; if that is lost, the sweeper sends
-- the call again; an abort has no such ender: due now), and its children still running
-- are aborted with it, in this same step.
local function tree_end(id)
  local f = redis.call('HMGET', key_of(id, 1), 'children', 'ancestors', 'parent_key', 'status')
  local parent = f[2] and string.match(f[2], '^(%S+)')
  if parent then
    local pk, ck = key_of(parent, 1), key_of(parent, 4)
    local ps = redis.call('HGET', pk, 'status')
    if ps then redis.call('HINCRBY', pk, 'children_waiting', -1) end
    local c = ps and not ended(ps) and parse(redis.call('HGET', ck, f[3]))
    if c and c.kind == 'q' then
      local due = f[4] == 'aborted' and NOW or NOW + LEASE
      redis.call('HSET', ck, f[3], table.concat({c.kind, int(due), int(c.attempts),
        int(c.gen), int(c.taken), c.owner, c.err}, '|'))
      redis.call('ZADD', LEASES, 'LT', due, parent)
    end
  end
  if not f[1] then return end
  for _, child in ipairs(cjson.decode(f[1])) do
    local st = redis.call('HMGET', key_of(child, 1), 'status', 'iteration', 'tenant')
    if st[1] and not ended(st[1]) then
      redis.call('HSET', key_of(child, 1), 'status', 'aborted', 'exit', 'aborted', 'content', '',
        'result', '', 'error', 'aborted by tooloop: its parent run ' .. id .. ' ended',
        'error_type', 'Aborted', 'phase', 'done', 'ended_at', NOW, 'updated_at', NOW)
      local events = key_of(child, 8)
      redis.call('XADD', events, 'MAXLEN', '~', MAXLEN, '*', 'type', 'control', 'ts', NOW,
        'action', 'abort', 'by', 'parent:' .. id)
      redis.call('XADD', events, 'MAXLEN', '~', MAXLEN, '*', 'type', 'outcome', 'ts', NOW,
        'iteration', st[2] or 0, 'exit', 'aborted', 'status', 'aborted')
      for i = 1, NRUN do redis.call('EXPIRE', key_of(child, i), TTL) end
      redis.call('ZREM', LEASES, child)
      redis.call('ZADD', EXPIRY, NOW + TTL * 1000, child .. '\\t' .. (st[3] or 'default'))
      tree_end(child)
    end
  end
end

-- A child run whose tree's budget is spent: an ancestor's tokens or cost (which count its
-- children's) reached the budget it had when it started children. -> why, error type | nil
local function tree_spent()
  local anc = redis.call('HGET', RUN, 'ancestors')
  if not anc then return nil end
  for id in string.gmatch(anc, '%S+') do
    local a = redis.call('HMGET', key_of(id, 1), 'tokens_used', 'tree_token_budget', 'cost_usd',
      'tree_cost_budget')
    if a[2] and tonumber(a[1] or '0') >= tonumber(a[2]) then
      return 'token budget ' .. a[2] .. ' of run ' .. id .. ' spent (' .. a[1] ..
        ' tokens used by it and its children)', 'BudgetExceeded'
    end
    if a[4] and tonumber(a[3] or '0') >= tonumber(a[4]) then
      return 'cost budget $' .. a[4] .. ' of run ' .. id .. ' spent ($' .. a[3] ..
        ' by it and its children)', 'CostBudgetExceeded'
    end
  end
  return nil
end

-- Ends the run: result fields, the outcome event, the retention clock; the expiry
-- index tells the janitor when to drop it from the run indexes.
local function finish(status, exit, content, result, err, err_type)
  redis.call('HSET', RUN, 'status', status, 'exit', exit, 'content', content,
    'result', result, 'error', err, 'error_type', err_type, 'phase', 'done',
    'ended_at', NOW, 'updated_at', NOW)
  event('outcome', 'iteration', redis.call('HGET', RUN, 'iteration'), 'exit', exit,
    'status', status)
  expire_all()
  redis.call('ZREM', LEASES, RUN_ID)
  local tenant = redis.call('HGET', RUN, 'tenant') or 'default'
  redis.call('ZADD', EXPIRY, NOW + TTL * 1000, RUN_ID .. '\\t' .. tenant)
  tree_end(RUN_ID)
end

local function gave_up_text(step, attempts, err)
  local why = (err and err ~= '') and err or 'its worker was lost or timed out each time'
  return 'StepFailed: ' .. step .. ' failed ' .. attempts .. ' attempts; last: ' .. why
end

-- A turn past its attempts: the run ends on error.
local function give_up_turn(it, attempts, err)
  finish('failed', 'error', '', '', gave_up_text('turn ' .. it, attempts, err), 'StepFailed')
end

-- A call past its attempts: recorded failed (built here, whatever its payload holds),
-- then the run ends on error.
local function give_up_call(key, c)
  local text = gave_up_text('tool call ' .. key, c.attempts, c.err)
  local ok, p = pcall(cjson.decode, redis.call('HGET', CARGS, key) or '')
  if not ok or type(p) ~= 'table' then p = {} end
  local it = tonumber(string.match(key, '^(%d+)')) or 0
  local name = p.tool
  if type(name) ~= 'string' then name = '?' end
  local call_id = p.call_id
  if type(call_id) ~= 'string' then call_id = key end
  redis.call('HSET', CALLS, key, cjson.encode({call_id = call_id, tool_name = name,
    duration_ms = 0, success = false, error = text, iteration = it}))
  redis.call('HSET', CSTATE, key, 'd')
  event('tool_call', 'iteration', it, 'tool', name, 'success', 0)
  finish('failed', 'error', '', '', text, 'StepFailed')
end

-- A run under fair share (field ``fair``) counts its tokens into its tenant's, per 10 s
-- bucket of Redis time, in its shard (orchestrator/fairshare.py sums the shards' last minute).
local function tenant_tokens(tenant, n)
  local bucket = math.floor(NOW / 10000)
  redis.call('HINCRBY', TOKENS, tenant .. '|' .. int(bucket), n)
  redis.call('HINCRBY', TOKENS, tenant .. '|total', n)
  redis.call('HINCRBY', TOKENS, tenant .. '|replies', 1)
  redis.call('HDEL', TOKENS, tenant .. '|' .. int(bucket - 7))  -- past the window
end

-- A model reply's usage, '<tokens> <cost usd>' (kind: also counted apart, e.g. 'judge').
local function add_usage(usage, kind)
  local n, cost = string.match(usage, '^(%d+) ?([^ ]*)$')
  local total = redis.call('HINCRBY', RUN, 'tokens_used', n)
  if kind then redis.call('HINCRBY', RUN, 'tokens_' .. kind, n) end
  local priced = cost ~= '' and tonumber(cost) > 0
  if priced then redis.call('HINCRBYFLOAT', RUN, 'cost_usd', cost) end
  local f = redis.call('HMGET', RUN, 'ancestors', 'fair', 'tenant')
  if f[2] and tonumber(n) > 0 then tenant_tokens(f[3] or 'default', n) end
  -- a child run's spend counts into every ancestor's, as it happens
  for id in string.gmatch(f[1] or '', '%S+') do
    local ak = key_of(id, 1)
    if redis.call('EXISTS', ak) == 1 then
      redis.call('HINCRBY', ak, 'tokens_used', n)
      if priced then redis.call('HINCRBYFLOAT', ak, 'cost_usd', cost) end
    end
  end
  return total
end

-- The run's cost so far (USD, as stored): iteration events carry it, so a turn's cost shows.
local function cost_now() return redis.call('HGET', RUN, 'cost_usd') or '0' end

local function tokens_of(usage) return tonumber(string.match(usage, '^(%d+)')) or 0 end

-- Bills the reply of one claim (usage '<tokens> <cost usd>'), once: -> tokens_used, billed
local function bill(owner, usage)
  if owner ~= '' and redis.call('HDEL', CLAIMS, owner) == 1 then
    return add_usage(usage), true
  end
  return tonumber(redis.call('HGET', RUN, 'tokens_used')) or 0, false
end
"""

# KEYS: + the tenant's run index. ARGV: spec, tenant, fair share ('': none; 'track': count its
# tokens; 'gate': also hold its first turn until its tenant's queue admits it, see
# OPEN_GATE), messages... -> generation | 0 (exists)
CREATE = """
if redis.call('EXISTS', RUN) == 1 then return 0 end
redis.call('HSET', RUN, 'spec', arg(1), 'tenant', arg(2),
  'status', 'queued', 'phase', 'turn', 'iteration', 0, 'tokens_used', 0,
  'pending', 0, 'ncalls', 0, 'turn_claimed', 0, 'turn_gen', 1, 'turn_taken', 0,
  'turn_attempts', 0, 'turn_owner', '', 'turn_error', '', 'turn_deadline', NOW + LEASE,
  'created_at', NOW, 'updated_at', NOW)
if arg(3) ~= '' then redis.call('HSET', RUN, 'fair', 1) end
if arg(3) == 'gate' then redis.call('HSET', RUN, 'gate', 'new') end
for i = 4, #ARGV - 5 do redis.call('RPUSH', MSGS, arg(i)) end
event('queued')
redis.call('ZADD', RUNS, NOW, RUN_ID)
redis.call('ZADD', KEYS[EXTRA], NOW, RUN_ID)
redis.call('ZADD', LEASES, NOW + LEASE, RUN_ID)
return 1
"""

# ARGV: iteration wanted, generation, owner
# -> {'ok', spec, tokens_used, attempts, corrections, cost_usd, messages...}
#  | {'ended'|'paused'|'stale'|'busy'|'missing'|'gave_up'|'budget'} ('budget': a child run
#    ended here, its tree's budget spent: orchestrator/children.py)
CLAIM_TURN = """
local st = redis.call('HMGET', RUN, 'status', 'iteration', 'phase', 'turn_claimed',
  'turn_deadline', 'spec', 'tokens_used', 'turn_gen', 'turn_attempts', 'turn_error',
  'corrections', 'cost_usd', 'gate')
if not st[1] then return {'missing'} end
if ended(st[1]) then return {'ended'} end
if st[13] then return {'stale'} end  -- waiting for its tenant's share: no message is its
local it = tonumber(arg(1))
if st[1] == 'paused' then
  -- parked: this worker took the turn's current message and drops it; the resume sends
  -- the turn again without looking for it in the queue (it is not lost)
  if tonumber(st[2]) + 1 == it and st[3] == 'turn' and tonumber(arg(2)) >= (tonumber(st[8]) or 0) then
    redis.call('HSET', RUN, 'turn_taken', arg(2))
  end
  return {'paused'}
end
if tonumber(st[2]) + 1 ~= it or st[3] ~= 'turn' then return {'stale'} end
if tonumber(arg(2)) < (tonumber(st[8]) or 0) then return {'stale'} end  -- superseded message
if st[4] == '1' and tonumber(st[5]) > NOW then return {'busy'} end
local attempts = (tonumber(st[9]) or 0) + 1
redis.call('HSET', RUN, 'turn_taken', arg(2))
if attempts > cap_of(st[10]) then
  give_up_turn(it, attempts - 1, st[10])
  return {'gave_up'}
end
local spent, spent_type = tree_spent()  -- a child run: its tree's budget is spent
if spent then
  finish('failed', 'budget_exceeded', '', '', spent, spent_type)
  return {'budget'}
end
redis.call('HSET', RUN, 'status', 'running', 'turn_claimed', 1, 'turn_owner', arg(3),
  'turn_deadline', NOW + LEASE, 'turn_attempts', attempts, 'updated_at', NOW)
redis.call('HSETNX', RUN, 'started_at', NOW)
redis.call('HSET', CLAIMS, arg(3), it)
local steer = redis.call('LRANGE', STEER, 0, -1)
if #steer > 0 then
  redis.call('DEL', STEER)
  for i = 1, #steer do redis.call('RPUSH', MSGS, steer[i]) end
  event('control', 'action', 'steer_applied', 'count', #steer)
end
next_look()
local out = {'ok', st[6], st[7], attempts, st[11] or '0', st[12] or '0'}
for _, m in ipairs(redis.call('LRANGE', MSGS, 0, -1)) do out[#out + 1] = m end
return out
"""

# ARGV: iteration, owner, assistant message, usage ('<tokens> <cost usd>'), kind,
#   kind 'finish':   status, exit, content, result, error, error_type
#   kind 'tools':    (key, the model's call id, payload) triples
#   kind 'continue': messages to append (a corrective message): the next turn is due
# -> 'finished' | {'dispatch', call ids...} | 'continue:<next turn generation>'
#  | 'discarded' (run ended) | 'stale' (not the turn's owner) | 'missing'. The reply's
#  usage is billed in every case but 'missing'.
# Call ids: a model may repeat one (in a reply, or across turns), and a person decides an
# approval by it, so each call gets one of its own in the run: the model's, or, when that
# is taken, '<model id>~<key>' (its payload then keeps the model's as ``model_call_id``,
# for the tool message the model reads).
RECORD_REPLY = """
local st = redis.call('HMGET', RUN, 'status', 'iteration', 'phase', 'turn_owner')
if not st[1] then return 'missing' end
local it, owner = tonumber(arg(1)), arg(2)
local tokens, billed = bill(owner, arg(4))
-- this attempt's journal entry (orchestrator/journal.py): kept only with its recorded reply
local staged = 'p' .. arg(1) .. ':' .. owner
local entry = redis.call('HGET', JOURNAL, staged)
if entry then redis.call('HDEL', JOURNAL, staged) end
if ended(st[1]) then return 'discarded' end
if tonumber(st[2]) + 1 ~= it or st[3] ~= 'turn' or st[4] ~= owner then
  if billed then
    event('discarded', 'iteration', it, 'tokens', tokens_of(arg(4)), 'tokens_used', tokens)
  end
  return 'stale'
end
redis.call('RPUSH', MSGS, arg(3))
if entry then redis.call('HSET', JOURNAL, 't' .. arg(1), entry) end
redis.call('HSET', RUN, 'iteration', it, 'turn_claimed', 0, 'updated_at', NOW)
if arg(5) == 'finish' then
  event('iteration', 'iteration', it, 'tool_calls', 0, 'tokens_used', tokens, 'cost_usd', cost_now())
  finish(arg(6), arg(7), arg(8), arg(9), arg(10), arg(11))
  return 'finished'
end
if arg(5) == 'continue' then
  for i = 6, #ARGV - 5 do redis.call('RPUSH', MSGS, arg(i)) end
  redis.call('HINCRBY', RUN, 'corrections', 1)
  local gen = redis.call('HINCRBY', RUN, 'turn_gen', 1)
  redis.call('HSET', RUN, 'turn_attempts', 0, 'turn_owner', '', 'turn_error', '',
    'turn_deadline', NOW + LEASE)
  event('iteration', 'iteration', it, 'tool_calls', 0, 'tokens_used', tokens, 'corrected', 1,
    'cost_usd', cost_now())
  next_look()
  return 'continue:' .. gen
end
local n = (#ARGV - 10) / 3
event('iteration', 'iteration', it, 'tool_calls', n, 'tokens_used', tokens, 'cost_usd', cost_now())
redis.call('HSET', RUN, 'phase', 'tools', 'pending', n, 'ncalls', n)
local ids = {'dispatch'}
for i = 6, 5 + 3 * n, 3 do
  local key, id, payload = arg(i), arg(i + 1), arg(i + 2)
  local unique, tries = id, 0
  while redis.call('HSETNX', CALLIDS, unique, key) == 0 do
    tries = tries + 1
    unique = id .. '~' .. key .. (tries > 1 and ('~' .. tries) or '')
  end
  if unique ~= id then
    local p = cjson.decode(payload)
    p.call_id, p.model_call_id = unique, id
    payload = cjson.encode(p)
  end
  ids[#ids + 1] = unique
  put(key, {kind = 'q', deadline = NOW + LEASE, attempts = 0, gen = 1, taken = 0,
            owner = '', err = ''})
  redis.call('HSET', CARGS, key, payload)
end
next_look()
return ids
"""

# A turn attempt that raised. ARGV: iteration, owner, usage of its reply ('0 0': none), error
# -> 'retry' (the next sweep sends it again) | 'gave_up' | 'stale' | 'ended' | 'missing'
FAIL_TURN = """
local st = redis.call('HMGET', RUN, 'status', 'iteration', 'phase', 'turn_owner',
  'turn_attempts')
if not st[1] then return 'missing' end
local it, owner = tonumber(arg(1)), arg(2)
local tokens, billed = bill(owner, arg(3))
if ended(st[1]) then return 'ended' end
if tonumber(st[2]) + 1 ~= it or st[3] ~= 'turn' or st[4] ~= owner then return 'stale' end
if billed and tokens_of(arg(3)) > 0 then
  event('discarded', 'iteration', it, 'tokens', tokens_of(arg(3)), 'tokens_used', tokens)
end
redis.call('HSET', RUN, 'turn_error', arg(4))
if (tonumber(st[5]) or 0) >= CAP then
  give_up_turn(it, st[5], arg(4))
  return 'gave_up'
end
redis.call('HSET', RUN, 'turn_claimed', 0, 'turn_deadline', NOW, 'updated_at', NOW)
next_look()
return 'retry'
"""

# Ends a run that has not ended yet (limits, model errors, abort, unreadable state).
# ARGV: status, exit, content, result, error, error_type, iteration to set ('' keeps
# it), then for a turn's own ending its iteration and owner (fenced: only the turn's
# current owner may end the run), '' for directives -> 1 | 0 (ended already, or fenced)
FINISH = """
local st = redis.call('HMGET', RUN, 'status', 'iteration', 'phase', 'turn_owner')
if not st[1] or ended(st[1]) then return 0 end
if arg(9) ~= '' then
  if tonumber(st[2]) + 1 ~= tonumber(arg(8)) or st[3] ~= 'turn' or st[4] ~= arg(9) then
    return 0
  end
end
if arg(7) ~= '' then redis.call('HSET', RUN, 'iteration', arg(7)) end
finish(arg(1), arg(2), arg(3), arg(4), arg(5), arg(6))
return 1
"""

# Claims a call for its message, and hands back what the call may do: the run's stored
# spec and the call as the turn stored it (worker/calls.py). The message only names the
# call; a message whose tool is not the stored call's is refused, touching nothing.
# ARGV: key, iteration, generation, owner, tool (the message's), '1' if this worker has
#   that tool, '1' if this worker gates it (@tool(approval=True)), idempotent ('1'/'0'; a
#   declared HTTP tool is not), '1' once this delivery passed the approval gate
# -> {'ok', spec, stored call} | {'lost', spec, stored call} (a non-idempotent call whose
#    earlier holder was lost: record that, never re-run) | {'gate', spec, stored call}
#    (ask the approval gate first, nothing changed) | {'elsewhere'} (an allowed tool this
#    worker lacks) | {'mismatch'} | {'busy'|'done'|'paused'|'ended'|'stale'|'gave_up'}
START_CALL = """
local st = redis.call('HMGET', RUN, 'status', 'iteration', 'phase', 'spec')
if not st[1] or ended(st[1]) then return {'ended'} end
if tonumber(st[2]) ~= tonumber(arg(2)) or st[3] ~= 'tools' then return {'stale'} end
local key = arg(1)
local c = parse(redis.call('HGET', CSTATE, key))
if not c then return {'stale'} end
if c.kind == 'd' then return {'done'} end
local raw = redis.call('HGET', CARGS, key) or ''
local decoded, p = pcall(cjson.decode, raw)
if not decoded or type(p) ~= 'table' then return {'mismatch'} end
if (type(p.tool) == 'string' and p.tool or '') ~= arg(5) then return {'mismatch'} end
local http = p.http == true or type(p.http_tool) == 'table'
if p.allowed == true and not http and arg(6) ~= '1' then return {'elsewhere'} end
-- the gate before the generation and pause checks: a decision is recorded on a paused
-- run, and its own fencing (orchestrator/approvals.py) drops a stale message's
if p.allowed == true and (p.approval == true or arg(7) == '1') and arg(9) ~= '1' then
  return {'gate', st[4], raw}
end
if tonumber(arg(3)) < c.gen then return {'stale'} end  -- superseded message
if c.kind == 's' and c.deadline > NOW then return {'busy'} end
if st[1] == 'paused' then
  if c.kind == 'q' or c.kind == 'x' then  -- parked: taken and dropped, sent again at resume
    c.taken = tonumber(arg(3))
    put(key, c)
  end
  return {'paused'}
end
local lost = c.kind ~= 'q' and (http or arg(8) ~= '1')
c.kind, c.deadline, c.owner, c.taken = 's', NOW + LEASE, arg(4), tonumber(arg(3))
c.attempts = c.attempts + 1
if c.attempts > cap_of(c.err) then
  c.attempts = c.attempts - 1
  give_up_call(key, c)
  return {'gave_up'}
end
put(key, c)
next_look()
return {lost and 'lost' or 'ok', st[4], raw}
"""

# ARGV: key, iteration, owner, generation, record, tool message, tool name, success
# Fenced: the call's owner, or with owner '' (the sweeper failing a call nobody runs)
# a call not started whose generation is still the one given.
# -> {'next', turn generation} | {'wait'} | {'paused'} | {'ended'} | {'dup'} | {'stale'}
RECORD_CALL = """
local key, owner = arg(1), arg(3)
local c = parse(redis.call('HGET', CSTATE, key))
if not c then return {'stale'} end
if c.kind == 'd' then return {'dup'} end
local mine
if owner ~= '' then mine = c.owner == owner and c.kind ~= 'q'
else mine = c.kind ~= 's' and c.gen == tonumber(arg(4)) end
if not mine then return {'stale'} end
local st = redis.call('HMGET', RUN, 'status', 'iteration', 'phase', 'ncalls')
if not st[1] then return {'stale'} end
redis.call('HSET', CALLS, key, arg(5))
redis.call('HSET', CSTATE, key, 'd')
redis.call('HSET', TMSGS, key, arg(6))
local pending = redis.call('HINCRBY', RUN, 'pending', -1)
event('tool_call', 'iteration', arg(2), 'tool', arg(7), 'success', arg(8))
if ended(st[1]) then expire_all() return {'ended'} end
if pending > 0 then next_look() return {'wait'} end
for i = 0, tonumber(st[4]) - 1 do
  redis.call('RPUSH', MSGS, redis.call('HGET', TMSGS, arg(2) .. '.' .. i))
end
redis.call('DEL', TMSGS, CARGS, CSTATE)
local gen = redis.call('HINCRBY', RUN, 'turn_gen', 1)
redis.call('HSET', RUN, 'phase', 'turn', 'turn_claimed', 0, 'turn_attempts', 0,
  'turn_owner', '', 'turn_error', '', 'turn_deadline', NOW + LEASE, 'updated_at', NOW)
next_look()
if st[1] == 'paused' then  -- parked: no message is sent; the resume sends the turn
  redis.call('HSET', RUN, 'turn_taken', gen)
  return {'paused'}
end
return {'next', gen}
"""

# A call attempt that raised in the worker's own code. ARGV: key, owner, error
# -> 'retry' (the next sweep sends it again) | 'gave_up' | 'stale'
FAIL_CALL = """
local st = redis.call('HGET', RUN, 'status')
if not st or ended(st) then return 'stale' end
local key = arg(1)
local c = parse(redis.call('HGET', CSTATE, key))
if not c or c.kind == 'd' or c.owner ~= arg(2) then return 'stale' end
c.err = arg(3)
if c.attempts >= CAP then give_up_call(key, c) return 'gave_up' end
c.kind, c.deadline = 'x', NOW
put(key, c)
next_look()
return 'retry'
"""

# Heartbeat of one held step. ARGV: kind ('turn'|'call'), key, owner, iteration
# -> 1 (extended, or re-taken after a lapse nobody acted on) | 0 (not ours) | -1 (ended)
BEAT = """
local st = redis.call('HMGET', RUN, 'status', 'iteration', 'phase', 'turn_owner')
if not st[1] or ended(st[1]) then return -1 end
if arg(1) == 'turn' then
  if st[4] ~= arg(3) or tonumber(st[2]) + 1 ~= tonumber(arg(4)) or st[3] ~= 'turn' then
    return 0
  end
  redis.call('HSET', RUN, 'turn_claimed', 1, 'turn_deadline', NOW + LEASE)
  next_look()
  return 1
end
local c = parse(redis.call('HGET', CSTATE, arg(2)))
if not c or c.kind == 'd' or c.owner ~= arg(3) then return 0 end
c.kind, c.deadline = 's', NOW + LEASE
put(arg(2), c)
next_look()
return 1
"""

# A step its holder will not finish (warm shutdown): its lease lapses now, and the
# attempt is not counted. ARGV: kind, key, owner, iteration -> 1 | 0 (not ours)
HAND_BACK = """
local st = redis.call('HMGET', RUN, 'status', 'iteration', 'phase', 'turn_owner',
  'turn_attempts')
if not st[1] or ended(st[1]) then return 0 end
if arg(1) == 'turn' then
  if st[4] ~= arg(3) or tonumber(st[2]) + 1 ~= tonumber(arg(4)) or st[3] ~= 'turn' then
    return 0
  end
  redis.call('HSET', RUN, 'turn_deadline', NOW, 'turn_attempts',
    math.max(0, (tonumber(st[5]) or 1) - 1))
  next_look()
  return 1
end
local c = parse(redis.call('HGET', CSTATE, arg(2)))
if not c or c.kind ~= 's' or c.owner ~= arg(3) then return 0 end
c.deadline, c.attempts = NOW, math.max(0, c.attempts - 1)
put(arg(2), c)
next_look()
return 1
"""

# ARGV: pause_max_s (ms), by -> 'ok' | 'already' | 'ended' | 'missing'
PAUSE = """
local status = redis.call('HGET', RUN, 'status')
if not status then return 'missing' end
if ended(status) then return 'ended' end
if status == 'paused' then return 'already' end
redis.call('HSET', RUN, 'status', 'paused', 'paused_at', NOW,
  'pause_deadline', NOW + tonumber(arg(1)), 'updated_at', NOW)
event('control', 'action', 'pause', 'by', arg(2))
next_look()
return 'ok'
"""

# Each waiting step comes back as RECOVER reads it: re-sent now ('send', a new
# generation) only when its message is known consumed (its holder was lost, or a
# worker took it); otherwise 'check': the caller looks for its message in the queue
# and calls RESEND only if it is gone, so a message still queued is not doubled.
# ARGV: by
# -> {'turn', 'turn', gen, iteration, 'send'|'check'}
#  | {'calls', (key, gen, 'send'|'check', payload)...} | {'none'}
#  | {'not_paused'|'ended'|'missing'}
RESUME = """
local st = redis.call('HMGET', RUN, 'status', 'phase', 'iteration', 'turn_claimed',
  'turn_deadline', 'turn_gen', 'turn_taken', 'gate')
if not st[1] then return {'missing'} end
if ended(st[1]) then return {'ended'} end
if st[1] ~= 'paused' then return {'not_paused'} end
redis.call('HSET', RUN, 'status', st[8] and 'queued' or 'running', 'paused_at', '',
  'pause_deadline', '', 'updated_at', NOW)
event('control', 'action', 'resume', 'by', arg(1))
if st[8] then next_look() return {'none'} end  -- still waiting for its share: OPEN_GATE sends
if st[2] == 'turn' then
  if st[4] == '1' and tonumber(st[5]) > NOW then next_look() return {'none'} end
  local gen, what = tonumber(st[6]) or 0, 'check'
  if st[4] == '1' or (tonumber(st[7]) or 0) >= gen then  -- holder lost, or taken
    gen, what = redis.call('HINCRBY', RUN, 'turn_gen', 1), 'send'
  end
  redis.call('HSET', RUN, 'turn_claimed', 0, 'turn_deadline', NOW + LEASE)
  next_look()
  return {'turn', 'turn', gen, tonumber(st[3]) + 1, what}
end
local out = {'calls'}
local states = redis.call('HGETALL', CSTATE)
for i = 1, #states, 2 do
  local c = parse(states[i + 1])
  if c.kind == 'q' or c.kind == 'x' then
    local what = 'check'
    if c.taken >= c.gen then c.gen, what = c.gen + 1, 'send' end  -- taken and dropped
    c.deadline = NOW + LEASE
    put(states[i], c)
    for _, v in ipairs({states[i], c.gen, what, redis.call('HGET', CARGS, states[i]) or ''}) do
      out[#out + 1] = v
    end
  end
end
next_look()
return out
"""

# ARGV: by, reason -> 'ok' | 'ended' | 'missing'
ABORT = """
local status = redis.call('HGET', RUN, 'status')
if not status then return 'missing' end
if ended(status) then return 'ended' end
event('control', 'action', 'abort', 'by', arg(1))
finish('aborted', 'aborted', '', '', 'aborted by ' .. arg(1) .. ': ' .. arg(2), 'Aborted')
return 'ok'
"""

# ARGV: message JSON, by, cap -> 'ok' | 'full' | 'ended' | 'missing'
STEER = """
local status = redis.call('HGET', RUN, 'status')
if not status then return 'missing' end
if ended(status) then return 'ended' end
if redis.call('LLEN', STEER) >= tonumber(arg(3)) then return 'full' end
redis.call('RPUSH', STEER, arg(1))
event('control', 'action', 'steer', 'by', arg(2))
return 'ok'
"""

# The sweeper's look at one run due in the lease index. A pause past its deadline ends
# the run here (only if still paused). For each step past its deadline:
#   its holder was lost, or its message was taken and dropped -> re-sent ('send', with
#     a `recovery` event), or given up at the attempts cap;
#   its message was never taken -> 'check': the caller looks for it in the queue and
#     calls RESEND only if it is gone (a late message is left alone).
# -> {'gone'|'ended'|'pause_expired'|'gave_up'}
#  | {'steps', ('turn', gen, iteration, 'send'|'check') | (key, gen, 'send'|'check', payload)...}
RECOVER = """
local st = redis.call('HMGET', RUN, 'status', 'phase', 'iteration', 'turn_deadline',
  'pause_deadline', 'turn_claimed', 'turn_gen', 'turn_taken', 'turn_attempts', 'turn_error')
if not st[1] then redis.call('ZREM', LEASES, RUN_ID) return {'gone'} end
if ended(st[1]) then redis.call('ZREM', LEASES, RUN_ID) return {'ended'} end
local paused = st[1] == 'paused'
if paused and tonumber(st[5]) and tonumber(st[5]) <= NOW then
  event('control', 'action', 'abort', 'by', 'tooloop')
  finish('aborted', 'aborted', '', '', 'aborted by tooloop: paused longer than pause_max_s',
    'Aborted')
  return {'pause_expired'}
end
local gate = redis.call('HGET', RUN, 'gate')
if gate == 'new' and not paused then  -- held for fair share, not yet in its tenant's queue
  redis.call('HSET', RUN, 'turn_deadline', NOW + LEASE)
  next_look()
  return {'gated'}
end
local out = {'steps'}
if gate then next_look() return out end
if st[2] == 'turn' and not paused and tonumber(st[4]) <= NOW then
  local it = tonumber(st[3]) + 1
  local gen, taken = tonumber(st[7]) or 0, tonumber(st[8]) or 0
  if st[6] == '1' or taken >= gen then  -- its holder was lost, or it failed
    if st[6] == '1' and (tonumber(st[9]) or 0) >= cap_of(st[10]) then
      give_up_turn(it, st[9], st[10])
      return {'gave_up'}
    end
    gen = redis.call('HINCRBY', RUN, 'turn_gen', 1)
    redis.call('HSET', RUN, 'turn_claimed', 0, 'turn_deadline', NOW + LEASE)
    event('recovery', 'step', 'turn', 'iteration', it, 'lost_since', st[4])
    for _, v in ipairs({'turn', gen, it, 'send'}) do out[#out + 1] = v end
  else
    redis.call('HSET', RUN, 'turn_deadline', NOW + LEASE)
    for _, v in ipairs({'turn', gen, it, 'check'}) do out[#out + 1] = v end
  end
elseif st[2] == 'tools' then
  local sent, since = 0, nil  -- since: the earliest lapsed lease of the calls sent again
  local states = redis.call('HGETALL', CSTATE)
  for i = 1, #states, 2 do
    local key, c = states[i], parse(states[i + 1])
    if c.kind ~= 'd' and not (paused and c.kind ~= 's') and c.deadline <= NOW then
      local what = 'check'
      if c.kind == 's' or c.taken >= c.gen then  -- holder lost, or taken and dropped
        if c.kind ~= 'q' and c.attempts >= cap_of(c.err) then
          give_up_call(key, c)
          return {'gave_up'}
        end
        if c.kind == 's' then c.kind = 'x' end
        if not since or c.deadline < since then since = c.deadline end
        c.gen, what, sent = c.gen + 1, 'send', sent + 1
      end
      c.deadline = NOW + LEASE
      put(key, c)
      for _, v in ipairs({key, c.gen, what, redis.call('HGET', CARGS, key) or ''}) do
        out[#out + 1] = v
      end
    end
  end
  if sent > 0 then
    event('recovery', 'step', 'tool_calls', 'iteration', st[3], 'count', sent, 'lost_since', int(since))
  end
end
next_look()
return out
"""

# A step whose message was never taken and is not in its queue: send it again.
# ARGV: step ('turn' or a call key), generation that went missing
# -> {'turn', iteration, gen} | {'call', gen, payload} | {'none'} (it moved on meanwhile)
RESEND = """
local st = redis.call('HMGET', RUN, 'status', 'phase', 'iteration', 'turn_claimed',
  'turn_gen', 'turn_taken', 'gate')
if not st[1] or ended(st[1]) or st[1] == 'paused' or st[7] then return {'none'} end
local gen = tonumber(arg(2))
if arg(1) == 'turn' then
  if st[2] ~= 'turn' or st[4] == '1' or tonumber(st[5]) ~= gen or tonumber(st[6]) >= gen then
    return {'none'}
  end
  gen = redis.call('HINCRBY', RUN, 'turn_gen', 1)
  redis.call('HSET', RUN, 'turn_deadline', NOW + LEASE)
  event('recovery', 'step', 'turn', 'iteration', tonumber(st[3]) + 1, 'lost_since', NOW)
  next_look()
  return {'turn', tonumber(st[3]) + 1, gen}
end
local c = parse(redis.call('HGET', CSTATE, arg(1)))
if not c or c.kind == 'd' or c.kind == 's' or c.gen ~= gen or c.taken >= gen then
  return {'none'}
end
c.gen, c.deadline = c.gen + 1, NOW + LEASE
put(arg(1), c)
event('recovery', 'step', 'tool_calls', 'iteration', st[3], 'count', 1, 'lost_since', NOW)
next_look()
return {'call', c.gen, redis.call('HGET', CARGS, arg(1))}
"""

# A turn waiting for rate-limit capacity hands its claim back until it is due again: a
# countdown message of the new generation brings it back (past the deadline the sweeper
# looks for it). The attempt is not counted, and nothing is billed (no reply).
# ARGV: iteration, owner, wait ms -> {'ok', generation} | {'ended'} | {'stale'}
DEFER_TURN = """
local st = redis.call('HMGET', RUN, 'status', 'iteration', 'phase', 'turn_owner',
  'turn_attempts')
if not st[1] or ended(st[1]) then return {'ended'} end
if tonumber(st[2]) + 1 ~= tonumber(arg(1)) or st[3] ~= 'turn' or st[4] ~= arg(2) then
  return {'stale'}
end
redis.call('HDEL', CLAIMS, arg(2))
local gen = redis.call('HINCRBY', RUN, 'turn_gen', 1)
redis.call('HSET', RUN, 'turn_claimed', 0, 'turn_owner', '', 'updated_at', NOW,
  'turn_deadline', NOW + tonumber(arg(3)) + LEASE,
  'turn_attempts', math.max(0, (tonumber(st[5]) or 1) - 1))
event('rate_limited', 'iteration', arg(1), 'wait_ms', arg(3))
next_look()
return {'ok', gen}
"""

# Context compaction (worker/compaction.py): the messages between the head and the recent
# ones are replaced by the summary, with the summary call's usage, in one step.
# The summary call's usage counts even when the history is no longer ours (its tokens were spent).
# ARGV: iteration, owner ('' : any live claim), expected length, head, start, usage, reason,
#   fallback (0/1), messages to put between head and messages[start:]...
# -> 'ok' | 'ended' | 'stale'
COMPACT = """
local st = redis.call('HMGET', RUN, 'status', 'iteration', 'phase', 'turn_claimed', 'turn_owner')
if not st[1] then return 'ended' end
local tokens = add_usage(arg(6), 'compaction')
if ended(st[1]) then return 'ended' end
if tonumber(st[2]) + 1 ~= tonumber(arg(1)) or st[3] ~= 'turn' or st[4] ~= '1' then return 'stale' end
if arg(2) ~= '' and st[5] ~= arg(2) then return 'stale' end
local all = redis.call('LRANGE', MSGS, 0, -1)
if #all ~= tonumber(arg(3)) then return 'stale' end
-- what leaves the history is kept in the journal: a fork before this turn puts it back
local removed, k = {}, 1
for i = tonumber(arg(4)) + 1, tonumber(arg(5)) do removed[#removed + 1] = all[i] end
while redis.call('HEXISTS', JOURNAL, 'c' .. arg(1) .. '.' .. k) == 1 do k = k + 1 end
redis.call('HSET', JOURNAL, 'c' .. arg(1) .. '.' .. k, cjson.encode({head = tonumber(arg(4)),
  inserted = #ARGV - 13, removed = removed}))
redis.call('DEL', MSGS)
local n = 0
for i = 1, tonumber(arg(4)) do redis.call('RPUSH', MSGS, all[i]) n = n + 1 end
for i = 9, #ARGV - 5 do redis.call('RPUSH', MSGS, arg(i)) n = n + 1 end
for i = tonumber(arg(5)) + 1, #all do redis.call('RPUSH', MSGS, all[i]) n = n + 1 end
event('compaction', 'iteration', arg(1), 'before', #all, 'after', n,
  'reason', arg(7), 'fallback', arg(8), 'tokens_used', tokens)
return 'ok'
"""

# A piece of the model's streamed reply. ARGV: iteration, text -> 1 | 0 (ended)
TEXT = """
local status = redis.call('HGET', RUN, 'status')
if not status or ended(status) then return 0 end
event('text', 'iteration', arg(1), 'text', arg(2))
return 1
"""

ADD_USAGE = """
if redis.call('EXISTS', RUN) == 0 then return false end
return add_usage(arg(2), arg(1))
"""

# ARGV: key, value, event fields... -> 1 (set) | 0 (already set)
# Supervisor bookkeeping: a rule fires at most once per run, never after it ended.
MARK_ONCE = """
if ended(redis.call('HGET', RUN, 'status')) then return 0 end
if redis.call('HSETNX', SUP, arg(1), arg(2)) == 0 then return 0 end
local fields = {}
for i = 3, #ARGV - 5 do fields[#fields + 1] = arg(i) end
event('supervisor', unpack(fields))
return 1
"""

# Tenant fair share (orchestrator/fairshare.py): a run created with a gate ('new') has no
# message sent until its tenant's queue admits it. MARK_WAITING: it waits there (its
# status reason ``waiting_share``; the queue, not the lease index, holds it now).
# -> 'ok' | 'open' (admitted meanwhile) | 'ended' | 'missing'
MARK_WAITING = """
local st = redis.call('HMGET', RUN, 'status', 'gate')
if not st[1] then return 'missing' end
if ended(st[1]) then return 'ended' end
if st[2] ~= 'new' then return st[2] and 'ok' or 'open' end
redis.call('HSET', RUN, 'gate', 'wait', 'reason', 'waiting_share', 'waiting_since', NOW)
event('waiting', 'reason', 'waiting_share')
next_look()
return 'ok'
"""

# Admitted: its first turn (or the turn it waits on) is due now, once.
# -> {'send', generation, iteration} | {'open'} (opened already) | {'paused'} (the resume
#    sends it) | {'ended'} | {'missing'}
OPEN_GATE = """
local st = redis.call('HMGET', RUN, 'status', 'gate', 'iteration', 'turn_gen', 'waiting_since')
if not st[1] then return {'missing'} end
if ended(st[1]) then return {'ended'} end
if not st[2] then return {'open'} end
redis.call('HDEL', RUN, 'gate', 'reason', 'waiting_since')
if st[2] == 'wait' then event('admitted', 'waited_ms', NOW - (tonumber(st[5]) or NOW)) end
redis.call('HSET', RUN, 'turn_claimed', 0, 'turn_deadline', NOW + LEASE, 'updated_at', NOW)
if st[1] == 'paused' then  -- parked: no message is sent; the resume sends the turn
  redis.call('HSET', RUN, 'turn_taken', st[4])
  next_look()
  return {'paused'}
end
next_look()
return {'send', tonumber(st[4]), tonumber(st[3]) + 1}
"""

# One shard's sweep: take its lock, then what is due. KEYS: lock, leases, expiry.
# ARGV: lock ms, holder, batch -> false (another sweeper has it) | {now, due runs, expired}
DUE = """
if not redis.call('SET', KEYS[1], ARGV[2], 'NX', 'PX', ARGV[1]) then return false end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
return {now, redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, ARGV[3]),
        redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, ARGV[3])}
"""

# Which of these task ids are in one slice of a kombu queue (a Redis list)? KEYS: the
# list. ARGV: the slice's first index (0: the newest message), its length, task ids
# -> {entries examined, ids found...}. One slice per call: Redis is never held for a pass
# over a long queue (RunStore.queued walks the slices).
QUEUED = """
local want = {}
for i = 3, #ARGV do want[ARGV[i]] = true end
local first = tonumber(ARGV[1])
local slice = redis.call('LRANGE', KEYS[1], first, first + tonumber(ARGV[2]) - 1)
local out = {#slice}
for _, m in ipairs(slice) do
  local id = string.match(m, '"id": ?"([^"]+)"')
  if id and want[id] then out[#out + 1] = id want[id] = nil end
end
return out
"""

# A step sent again goes to the consuming end of its queue: kombu's Redis transport pushes
# at the list's head (LPUSH) and takes from its tail (BRPOP), so a message moved to the tail
# is the next one taken. A lost step's run has waited a lease already; it does not wait again
# behind the work queued meanwhile. A step of a tenant below its fair share goes there too
# (orchestrator/fairshare.py: ahead). KEYS: the list. ARGV: task id, entries to look at (the
# message was just published: it is among the newest, read 16 at a time: most often the
# first slice has it) -> 1 (moved) | 0 (not found: left)
JUMP = """
local most = tonumber(ARGV[2])
for first = 0, most - 1, 16 do
  local slice = redis.call('LRANGE', KEYS[1], first, math.min(first + 16, most) - 1)
  for _, m in ipairs(slice) do
    if string.match(m, '"id": ?"([^"]+)"') == ARGV[1] then
      redis.call('LREM', KEYS[1], 1, m)
      redis.call('RPUSH', KEYS[1], m)
      return 1
    end
  end
  if #slice < 16 then return 0 end
end
return 0
"""

# The worker registry and Redis's clock in one round trip (a submit checks its tools against
# the live workers' catalog). KEYS: the registry hash -> {seconds, micros, field, value, ...}
WORKERS = """
local clock = redis.call('TIME')
local out = {clock[1], clock[2]}
for _, v in ipairs(redis.call('HGETALL', KEYS[1])) do out[#out + 1] = v end
return out
"""

# The scripts that run on one run's keys (PRELUDE + script); DUE, QUEUED, JUMP and WORKERS
# stand alone.
RUN_SCRIPTS = (
    "CREATE", "CLAIM_TURN", "RECORD_REPLY", "FAIL_TURN", "FINISH", "START_CALL",
    "RECORD_CALL", "FAIL_CALL", "BEAT", "HAND_BACK", "PAUSE", "RESUME", "ABORT", "STEER",
    "RECOVER", "RESEND", "MARK_ONCE", "DEFER_TURN", "ADD_USAGE", "COMPACT", "TEXT",
    "MARK_WAITING", "OPEN_GATE",
)  # fmt: skip
