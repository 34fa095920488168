-- Claims' homes in one shard of a spread namespace: the compare-and-sets of the claim protocol
-- (filters/index/claims.py), one per op, in order. KEYS: the slice hashes the ops name (all declared).
-- ARGV: claim TTL (ms), key TTL (ms), the window's horizon (event time), the numbers in KEYS of the live
--       slices (comma-separated), then per op: its code, the number of its key in KEYS, the id, its event
--       time, an argument (create/put: the entry; note: the noter as <ts: f64 LE><id length: u32 LE><id>;
--       commit: how many notes the claimant has seen; else '').
-- An id whose entry is live (event time at the horizon or later) in any of the slices is there already:
-- a create or put of it is a replay ('C', 0), as in the slot layout (the first entry of an id wins); an
-- entry no longer live is written over. The other ops concern the claim of the id at their event time:
-- a home holding another one is gone for them.
-- A home is the entry field e<id> and, while the claim is undecided, the state field c<id> =
-- 'P' <deadline: f64 BE, ms of this node's clock> <notes>. Committed: the entry without a state. Gone:
-- neither. Returns per op {state ('C', 'P' or 'G'), the entry ('' if not asked for), the notes}; put:
-- 1 (written) or 0 (the id was there already).
local claim_ttl, ttl, horizon = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local live = {}
for k in string.gmatch(ARGV[4], '[^,]+') do live[#live + 1] = KEYS[tonumber(k)] end
local function elsewhere(key, ef)  -- a live entry of the id in another of the live slices
  for _, other in ipairs(live) do
    if other ~= key then
      local e = redis.call('HGET', other, ef)
      if e and struct.unpack('<d', e, 2) >= horizon then return true end
    end
  end
  return false
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
local touched = {}
local i = 5
while i <= #ARGV do
  local op, key, id, ts, arg = ARGV[i], KEYS[tonumber(ARGV[i + 1])], ARGV[i + 2], tonumber(ARGV[i + 3]), ARGV[i + 4]
  i = i + 5
  local ef, cf = 'e' .. id, 'c' .. id
  local got = redis.call('HMGET', key, ef, cf)
  local e, c = got[1], got[2]
  if e then
    local at = struct.unpack('<d', e, 2)
    if op == 'create' or op == 'put' then
      if at < horizon then e, c = nil, nil end  -- left the window: as if absent
    elseif at ~= ts then
      e, c = nil, nil  -- another claim of the id: the one asked about is gone
    end
  end
  local reply
  if op == 'put' then  -- a restored entry: committed at once (nothing to decide)
    if e or elsewhere(key, ef) then
      reply = 0
    else
      redis.call('HSET', key, ef, arg)
      redis.call('HINCRBY', key, 'n', 1)
      touched[key] = true
      reply = 1
    end
  elseif not c then
    if e and op ~= 'create' then
      reply = {'C', op == 'commit' and '' or e, ''}
    elseif e or op == 'create' and elsewhere(key, ef) then
      reply = {'C', '', ''}  -- committed already: a replay
    elseif op == 'create' then
      redis.call('HSET', key, ef, arg, cf, 'P' .. struct.pack('>d', now + claim_ttl))
      touched[key] = true
      reply = {'P', '', ''}
    else
      reply = {'G', '', ''}
    end
  else
    local deadline = struct.unpack('>d', c, 2)
    local notes = string.sub(c, 10)
    if op == 'create' or op == 'refresh' then  -- taken over / kept alive: a fresh deadline, the notes stay
      redis.call('HSET', key, cf, 'P' .. struct.pack('>d', now + claim_ttl) .. notes)
      touched[key] = true
      reply = {'P', '', notes}
    elseif op == 'note' then
      notes = notes .. arg
      redis.call('HSET', key, cf, string.sub(c, 1, 9) .. notes)
      reply = {'P', e, notes}
    elseif op == 'commit' then
      local seen, count, p = tonumber(arg), 0, 1
      while p <= #notes do
        local _, n = struct.unpack('<dI4', notes, p)
        p = p + 12 + n
        count = count + 1
      end
      if count <= seen then
        redis.call('HDEL', key, cf)
        redis.call('HINCRBY', key, 'n', 1)
        reply = {'C', '', ''}
      else
        reply = {'P', '', notes}
      end
    elseif op == 'poll' and deadline < now or op == 'abort' then
      redis.call('HDEL', key, ef, cf)
      reply = {'G', '', ''}
    elseif op == 'poll' or op == 'state' then
      reply = {'P', e, notes}
    else
      return redis.error_reply('ERR unknown op ' .. op)
    end
  end
  out[#out + 1] = reply
end
for key in pairs(touched) do redis.call('PEXPIRE', key, ttl) end
return out
