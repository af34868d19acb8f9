"""Lua scripts: each state change of a run is one atomic round trip.

Every script receives the same KEYS, the run's keys in the order of
``Keys.all_for_run`` (they share one hash tag), so the helpers in ``PRELUDE``
can name them. Deadlines are milliseconds since the epoch, passed in by the
caller so all workers agree on one clock source per step.

Call states (hash CSTATE, one field per call ``<iteration>.<index>``):
  ``q|<deadline>``  dispatched, not started; re-dispatched after the deadline
  ``s|<deadline>``  started under a lease the executing worker heartbeats
  ``x|<deadline>``  started, then its lease expired: re-dispatched; a re-run
                    happens only for idempotent tools
  ``d``             recorded
"""

PRELUDE = """
local RUN, MSGS, CALLS, CSTATE, CARGS, TMSGS, STEER, EVENTS, SUP =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9]

local function ended(status)
  return status == 'completed' or status == 'failed' or status == 'aborted'
end

local function event(maxlen, now, kind, ...)
  redis.call('XADD', EVENTS, 'MAXLEN', '~', maxlen, '*', 'type', kind, 'ts', now, ...)
end

local function expire_all(ttl)
  for i = 1, #KEYS do redis.call('EXPIRE', KEYS[i], ttl) end
end

-- Ends the run: result fields, the outcome event, the retention clock.
local function finish(now, maxlen, ttl, status, exit, content, result, err, err_type)
  redis.call('HSET', RUN, 'status', status, 'exit', exit, 'content', content,
    'result', result, 'error', err, 'error_type', err_type, 'phase', 'done',
    'ended_at', now, 'updated_at', now)
  event(maxlen, now, 'outcome', 'iteration', redis.call('HGET', RUN, 'iteration'),
    'exit', exit, 'status', status)
  expire_all(ttl)
end

local function deadline_of(state)
  return tonumber(string.sub(state, 3)) or 0
end
"""

# ARGV: now, maxlen, spec, tenant, first turn deadline, messages... -> 1 | 0 (exists)
CREATE = """
if redis.call('EXISTS', RUN) == 1 then return 0 end
local now, maxlen = ARGV[1], ARGV[2]
redis.call('HSET', RUN, 'spec', ARGV[3], 'tenant', ARGV[4],
  'status', 'queued', 'phase', 'turn', 'iteration', 0, 'tokens_used', 0,
  'pending', 0, 'ncalls', 0, 'turn_claimed', 0, 'turn_deadline', ARGV[5],
  'created_at', now, 'updated_at', now)
for i = 6, #ARGV do redis.call('RPUSH', MSGS, ARGV[i]) end
event(maxlen, now, 'queued')
return 1
"""

# ARGV: iteration wanted, now, lease deadline, maxlen
# -> {'ok', spec, tokens_used, messages...} | {'ended'|'paused'|'stale'|'busy'|'missing'}
CLAIM_TURN = """
local st = redis.call('HMGET', RUN, 'status', 'iteration', 'phase', 'turn_claimed',
  'turn_deadline', 'spec', 'tokens_used')
if not st[1] then return {'missing'} end
if ended(st[1]) then return {'ended'} end
if st[1] == 'paused' then return {'paused'} end
if tonumber(st[2]) + 1 ~= tonumber(ARGV[1]) or st[3] ~= 'turn' then return {'stale'} end
local now = tonumber(ARGV[2])
if st[4] == '1' and tonumber(st[5]) > now then return {'busy'} end
redis.call('HSET', RUN, 'status', 'running', 'turn_claimed', 1, 'turn_deadline', ARGV[3],
  'updated_at', ARGV[2])
redis.call('HSETNX', RUN, 'started_at', ARGV[2])
local steer = redis.call('LRANGE', STEER, 0, -1)
if #steer > 0 then
  redis.call('DEL', STEER)
  for i = 1, #steer do redis.call('RPUSH', MSGS, steer[i]) end
  event(ARGV[4], ARGV[2], 'control', 'action', 'steer_applied', 'count', #steer)
end
local out = {'ok', st[6], st[7]}
for _, m in ipairs(redis.call('LRANGE', MSGS, 0, -1)) do out[#out + 1] = m end
return out
"""

# ARGV: iteration, now, maxlen, ttl, assistant message, tokens, kind,
#   kind 'finish': status, exit, content, result, error, error_type
#   kind 'tools':  deadline, then (key, payload) pairs
# -> 'finished' | 'dispatch' | 'discarded' | 'stale'
RECORD_REPLY = """
local st = redis.call('HMGET', RUN, 'status', 'iteration', 'phase')
if not st[1] or ended(st[1]) then return 'discarded' end
local it = tonumber(ARGV[1])
if tonumber(st[2]) + 1 ~= it or st[3] ~= 'turn' then return 'stale' end
local now, maxlen = ARGV[2], ARGV[3]
redis.call('RPUSH', MSGS, ARGV[5])
local tokens = redis.call('HINCRBY', RUN, 'tokens_used', ARGV[6])
redis.call('HSET', RUN, 'iteration', it, 'turn_claimed', 0, 'updated_at', now)
if ARGV[7] == 'finish' then
  event(maxlen, now, 'iteration', 'iteration', it, 'tool_calls', 0, 'tokens_used', tokens)
  finish(now, maxlen, ARGV[4], ARGV[8], ARGV[9], ARGV[10], ARGV[11], ARGV[12], ARGV[13])
  return 'finished'
end
local n = (#ARGV - 8) / 2
event(maxlen, now, 'iteration', 'iteration', it, 'tool_calls', n, 'tokens_used', tokens)
redis.call('HSET', RUN, 'phase', 'tools', 'pending', n, 'ncalls', n)
for i = 9, #ARGV, 2 do
  redis.call('HSET', CSTATE, ARGV[i], 'q|' .. ARGV[8])
  redis.call('HSET', CARGS, ARGV[i], ARGV[i + 1])
end
return 'dispatch'
"""

# Ends a run that is not ended yet (limits, model errors, abort, pause timeout).
# ARGV: now, maxlen, ttl, status, exit, content, result, error, error_type, iterations
# ('' keeps the iteration count) -> 1 | 0 (already ended)
FINISH = """
local status = redis.call('HGET', RUN, 'status')
if not status or ended(status) then return 0 end
if ARGV[10] ~= '' then redis.call('HSET', RUN, 'iteration', ARGV[10]) end
finish(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9])
return 1
"""

# ARGV: key, iteration, now, lease deadline, idempotent ('1'/'0')
# -> 'ok' | 'lost' | 'busy' | 'done' | 'paused' | 'ended' | 'stale'
START_CALL = """
local st = redis.call('HMGET', RUN, 'status', 'iteration', 'phase')
if not st[1] or ended(st[1]) then return 'ended' end
if tonumber(st[2]) ~= tonumber(ARGV[2]) or st[3] ~= 'tools' then return 'stale' end
local state = redis.call('HGET', CSTATE, ARGV[1])
if not state then return 'stale' end
if state == 'd' then return 'done' end
local kind = string.sub(state, 1, 1)
if kind == 's' and deadline_of(state) > tonumber(ARGV[3]) then return 'busy' end
if st[1] == 'paused' then return 'paused' end
if kind ~= 'q' and ARGV[5] ~= '1' then return 'lost' end
redis.call('HSET', CSTATE, ARGV[1], 's|' .. ARGV[4])
return 'ok'
"""

# ARGV: key, iteration, now, maxlen, ttl, record, tool message, tool name, success,
#   next turn deadline
# -> 'next' | 'wait' | 'paused' | 'ended' | 'dup' | 'stale'
RECORD_CALL = """
local state = redis.call('HGET', CSTATE, ARGV[1])
if not state or state == 'd' then return 'dup' end
local st = redis.call('HMGET', RUN, 'status', 'iteration', 'phase', 'ncalls')
if tonumber(st[2]) ~= tonumber(ARGV[2]) or st[3] ~= 'tools' then return 'stale' end
local now, maxlen = ARGV[3], ARGV[4]
redis.call('HSET', CALLS, ARGV[1], ARGV[6])
redis.call('HSET', CSTATE, ARGV[1], 'd')
redis.call('HSET', TMSGS, ARGV[1], ARGV[7])
local pending = redis.call('HINCRBY', RUN, 'pending', -1)
event(maxlen, now, 'tool_call', 'iteration', ARGV[2], 'tool', ARGV[8], 'success', ARGV[9])
if ended(st[1]) then expire_all(ARGV[5]) return 'ended' end
if pending > 0 then return 'wait' end
for i = 0, tonumber(st[4]) - 1 do
  local k = ARGV[2] .. '.' .. i
  redis.call('RPUSH', MSGS, redis.call('HGET', TMSGS, k))
end
redis.call('DEL', TMSGS, CARGS)
redis.call('HSET', RUN, 'phase', 'turn', 'turn_claimed', 0, 'turn_deadline', ARGV[10],
  'updated_at', now)
if st[1] == 'paused' then return 'paused' end
return 'next'
"""

# Heartbeat of one in-flight step. ARGV: kind ('turn'|'call'), key, new deadline
# -> 1 (extended) | 0 (no longer ours) | -1 (run ended)
BEAT = """
if ARGV[1] == 'turn' then
  if redis.call('HGET', RUN, 'turn_claimed') ~= '1' then return 0 end
  redis.call('HSET', RUN, 'turn_deadline', ARGV[3])
  return 1
end
if ended(redis.call('HGET', RUN, 'status')) then return -1 end
local state = redis.call('HGET', CSTATE, ARGV[2])
if not state or string.sub(state, 1, 1) ~= 's' then return 0 end
redis.call('HSET', CSTATE, ARGV[2], 's|' .. ARGV[3])
return 1
"""

# ARGV: now, maxlen, pause deadline, by -> 'ok' | 'already' | 'ended' | 'missing'
PAUSE = """
local status = redis.call('HGET', RUN, 'status')
if not status then return 'missing' end
if ended(status) then return 'ended' end
if status == 'paused' then return 'already' end
redis.call('HSET', RUN, 'status', 'paused', 'paused_at', ARGV[1],
  'pause_deadline', ARGV[3], 'updated_at', ARGV[1])
event(ARGV[2], ARGV[1], 'control', 'action', 'pause', 'by', ARGV[4])
return 'ok'
"""

# ARGV: now, maxlen, new deadline, by
# -> {'turn', iteration} | {'calls', payload...} | {'none'} | {'not_paused'|'ended'|'missing'}
RESUME = """
local st = redis.call('HMGET', RUN, 'status', 'phase', 'iteration', 'turn_claimed',
  'turn_deadline')
if not st[1] then return {'missing'} end
if ended(st[1]) then return {'ended'} end
if st[1] ~= 'paused' then return {'not_paused'} end
local now = tonumber(ARGV[1])
redis.call('HSET', RUN, 'status', 'running', 'paused_at', '', 'pause_deadline', '',
  'updated_at', ARGV[1])
event(ARGV[2], ARGV[1], 'control', 'action', 'resume', 'by', ARGV[4])
if st[2] == 'turn' then
  if st[4] == '1' and tonumber(st[5]) > now then return {'none'} end
  redis.call('HSET', RUN, 'turn_claimed', 0, 'turn_deadline', ARGV[3])
  return {'turn', tonumber(st[3]) + 1}
end
local out = {'calls'}
local states = redis.call('HGETALL', CSTATE)
for i = 1, #states, 2 do
  local kind = string.sub(states[i + 1], 1, 1)
  if kind == 'q' or kind == 'x' then
    redis.call('HSET', CSTATE, states[i], kind .. '|' .. ARGV[3])
    out[#out + 1] = redis.call('HGET', CARGS, states[i])
  end
end
return out
"""

# ARGV: now, maxlen, ttl, by, reason -> 'ok' | 'ended' | 'missing'
ABORT = """
local status = redis.call('HGET', RUN, 'status')
if not status then return 'missing' end
if ended(status) then return 'ended' end
event(ARGV[2], ARGV[1], 'control', 'action', 'abort', 'by', ARGV[4])
finish(ARGV[1], ARGV[2], ARGV[3], 'aborted', 'aborted', '', '',
  'aborted by ' .. ARGV[4] .. ': ' .. ARGV[5], 'Aborted')
return 'ok'
"""

# ARGV: now, maxlen, message JSON, by -> 'ok' | 'ended' | 'missing'
STEER = """
local status = redis.call('HGET', RUN, 'status')
if not status then return 'missing' end
if ended(status) then return 'ended' end
redis.call('RPUSH', STEER, ARGV[3])
event(ARGV[2], ARGV[1], 'control', 'action', 'steer', 'by', ARGV[4])
return 'ok'
"""

# The sweeper's look at one run. ARGV: now, new deadline, maxlen. A re-dispatch emits
# a `recovery` event (metadata: which step, since when its lease had expired).
# -> {'ended'|'gone'} | {'pause_expired'} | {'wait', next_check}
#  | {'turn', next_check, iteration} | {'calls', next_check, payload...}
RECOVER = """
local st = redis.call('HMGET', RUN, 'status', 'phase', 'iteration', 'turn_deadline',
  'pause_deadline')
if not st[1] then return {'gone'} end
if ended(st[1]) then return {'ended'} end
local now, fresh = tonumber(ARGV[1]), tonumber(ARGV[2])
local paused, next_check = st[1] == 'paused', fresh
if paused then
  local pause_deadline = tonumber(st[5])
  if pause_deadline and pause_deadline <= now then return {'pause_expired'} end
  if pause_deadline then next_check = math.min(next_check, pause_deadline) end
end
if st[2] == 'turn' then
  local deadline = tonumber(st[4])
  if paused then return {'wait', next_check} end
  if deadline > now then return {'wait', math.min(deadline, next_check)} end
  redis.call('HSET', RUN, 'turn_claimed', 0, 'turn_deadline', fresh)
  event(ARGV[3], ARGV[1], 'recovery', 'step', 'turn', 'iteration', tonumber(st[3]) + 1,
    'lost_since', deadline)
  return {'turn', next_check, tonumber(st[3]) + 1}
end
local out = {'calls', next_check}
local states = redis.call('HGETALL', CSTATE)
for i = 1, #states, 2 do
  local state = states[i + 1]
  local kind = string.sub(state, 1, 1)
  -- while paused, only calls that had started are watched
  if state ~= 'd' and not (paused and kind ~= 's') then
    local deadline = deadline_of(state)
    if deadline > now then
      next_check = math.min(next_check, deadline)
    else
      redis.call('HSET', CSTATE, states[i], (kind == 'q' and 'q|' or 'x|') .. fresh)
      out[#out + 1] = redis.call('HGET', CARGS, states[i])
    end
  end
end
if #out == 2 then return {'wait', next_check} end
event(ARGV[3], ARGV[1], 'recovery', 'step', 'tool_calls', 'iteration', st[3], 'count', #out - 2)
out[2] = next_check
return out
"""

# ARGV: key, value, now, maxlen, event fields... -> 1 (set) | 0 (already set)
# Supervisor bookkeeping: a rule fires at most once per run, never after it ended.
MARK_ONCE = """
if ended(redis.call('HGET', RUN, 'status')) then return 0 end
if redis.call('HSETNX', SUP, ARGV[1], ARGV[2]) == 0 then return 0 end
local fields = {}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
event(ARGV[4], ARGV[3], 'supervisor', unpack(fields))
return 1
"""
