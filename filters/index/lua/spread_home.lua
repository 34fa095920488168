-- Claims' homes in one shard of a spread namespace: the compare-and-sets of the claim protocol
-- (filters/index/claims.py), one per op, in order. KEYS[1]: the shard's meta hash; KEYS[2..]: the slice
-- hashes the ops name (all declared).
-- ARGV: claim TTL (ms), key TTL (ms), the window's horizon (event time), the numbers in KEYS of the live
--       slices (comma-separated), the highest event time the ops create ('' if none: the shard's
--       high-water mark moves to it), the ops' numbers (below), then per op: the id and, for a create or
--       put, the entry, for a note, the noter as <ts: f64 LE><id length: u32 LE><id>. The numbers, per
--       op, little-endian: its code (B: 1 create, 2 note, 3 commit, 4 poll, 5 refresh, 6 abort, 7 put),
--       the number of its key in KEYS (H), its event time (d) and, for a commit, how many notes the
--       claimant has seen (I4; else 0). (One argument for all the numbers: an argument costs a string in
--       the Lua VM.)
-- A home is the entry field e<id> and, while the claim is undecided, the state field c<id> =
-- 'P' <deadline: f64 BE, ms of this node's clock> <notes>. Committed: the entry without a state. Gone:
-- neither. An id whose entry is live (event time at the horizon or later) in any of the live slices is
-- there already: a create or put of it is a replay ('C', 0), as in the slot layout (the first entry of an
-- id wins); an entry no longer live is written over. The other ops concern the claim of the id at their
-- event time: a home holding another one is gone for them. Returns per op {state ('C', 'P' or 'G'), the
-- entry ('' if not asked for), the notes}; put: 1 (written) or 0 (the id was there already).
local meta = KEYS[1]
local claim_ttl, ttl, horizon, top = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[5])
local live = {}
for k in string.gmatch(ARGV[4], '[^,]+') do live[#live + 1] = KEYS[tonumber(k)] end
local CREATE, NOTE, COMMIT, POLL, REFRESH, ABORT, PUT = 1, 2, 3, 4, 5, 6, 7
-- The ops, in columns; and the fields they may read, per key, read at once (a field named by two ops is
-- read twice: the ops of one call are for different ids, but for polls).
local codes, keyed, efs, cfs, tss, args, seens = {}, {}, {}, {}, {}, {}, {}
local names = {}  -- key -> the fields to read there
local timed = false  -- an op needs this node's clock
local layout = ARGV[6]
local n, i, at = 0, 7, 1
while at <= #layout do
  local code, k, ts, seen
  code, k, ts, seen, at = struct.unpack('<BHdI4', layout, at)
  local id = ARGV[i]
  local key, ef, cf = KEYS[k], 'e' .. id, 'c' .. id
  n = n + 1
  codes[n], keyed[n], efs[n], cfs[n], tss[n], seens[n] = code, key, ef, cf, ts, seen
  local creates = code == CREATE or code == PUT
  if creates or code == NOTE then args[n] = ARGV[i + 1]; i = i + 2 else i = i + 1 end
  timed = timed or code == CREATE or code == REFRESH or code == POLL
  local l = names[key]
  if not l then l = {}; names[key] = l end
  l[#l + 1] = ef
  l[#l + 1] = cf
  if creates then
    for _, other in ipairs(live) do
      if other ~= key then
        local o = names[other]
        if not o then o = {}; names[other] = o end
        o[#o + 1] = ef
      end
    end
  end
end
local now, fresh = 0, nil  -- this node's clock (ms); a pending state with a fresh deadline
if timed then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  fresh = 'P' .. struct.pack('>d', now + claim_ttl)
end
local COMMITTED, PENDING, GONE = {'C', '', ''}, {'P', '', ''}, {'G', '', ''}  -- the replies without data
local PER_CALL = FIELDS_PER_CALL
local val = {}  -- key -> field -> value (false: absent), as the ops leave them
for key, l in pairs(names) do
  local v = {}
  for a = 1, #l, PER_CALL do
    local b = math.min(a + PER_CALL - 1, #l)
    local got = redis.call('HMGET', key, unpack(l, a, b))
    for j = a, b do v[l[j]] = got[j - a + 1] end
  end
  val[key] = v
end
local set, del, counted, touched = {}, {}, {}, {}
local function put(key, field, value)
  val[key][field] = value
  local s = set[key]
  if not s then s = {}; set[key] = s end
  s[field] = value
  if del[key] then del[key][field] = nil end
end
local function drop(key, field)
  val[key][field] = false
  local d = del[key]
  if not d then d = {}; del[key] = d end
  d[field] = true
  if set[key] then set[key][field] = nil end
end
local function elsewhere(key, ef)  -- a live entry of the id in another of the live slices
  for _, other in ipairs(live) do
    if other ~= key then
      local e = val[other][ef]
      if e and struct.unpack('<d', e, 2) >= horizon then return true end
    end
  end
  return false
end
local out = {}
for o = 1, n do
  local code, key, ef, cf, ts, arg = codes[o], keyed[o], efs[o], cfs[o], tss[o], args[o]
  local here = val[key]
  local e, c = here[ef], here[cf]
  local creates = code == CREATE or code == PUT
  if e then
    local at = struct.unpack('<d', e, 2)
    if creates then
      if at < horizon then e, c = false, false end  -- left the window: as if absent
    elseif at ~= ts then
      e, c = false, false  -- another claim of the id: the one asked about is gone
    end
  end
  local reply
  if code == PUT then  -- a restored entry: committed at once (nothing to decide)
    if e or elsewhere(key, ef) then
      reply = 0
    else
      put(key, ef, arg)
      if c then drop(key, cf) end
      counted[key] = (counted[key] or 0) + 1
      touched[key] = true
      reply = 1
    end
  elseif not c then
    if e and code ~= CREATE then
      reply = {'C', code == COMMIT and '' or e, ''}
    elseif e or code == CREATE and elsewhere(key, ef) then
      reply = COMMITTED  -- committed already: a replay
    elseif code == CREATE then
      put(key, ef, arg)
      put(key, cf, fresh)
      touched[key] = true
      reply = PENDING
    else
      reply = GONE
    end
  else
    local deadline = struct.unpack('>d', c, 2)
    local notes = string.sub(c, 10)
    if code == CREATE or code == REFRESH then  -- taken over / kept alive: a fresh deadline, the notes stay
      put(key, cf, fresh .. notes)
      touched[key] = true
      reply = {'P', '', notes}
    elseif code == NOTE then
      notes = notes .. arg
      put(key, cf, string.sub(c, 1, 9) .. notes)
      reply = {'P', e, notes}
    elseif code == COMMIT then
      local seen, count, p = seens[o], 0, 1
      while p <= #notes do
        local _, n = struct.unpack('<dI4', notes, p)
        p = p + 12 + n
        count = count + 1
      end
      if count <= seen then
        drop(key, cf)
        counted[key] = (counted[key] or 0) + 1
        reply = COMMITTED
      else
        reply = {'P', '', notes}
      end
    elseif code == POLL and deadline < now or code == ABORT then
      drop(key, ef)
      drop(key, cf)
      reply = GONE
    elseif code == POLL then
      reply = {'P', e, notes}
    else
      return redis.error_reply('ERR unknown op ' .. code)
    end
  end
  out[#out + 1] = reply
end
for key, s in pairs(set) do
  local args = {}
  for field, value in pairs(s) do args[#args + 1] = field; args[#args + 1] = value end
  for a = 1, #args, 2 * PER_CALL do
    redis.call('HSET', key, unpack(args, a, math.min(a + 2 * PER_CALL - 1, #args)))
  end
end
for key, d in pairs(del) do
  local args = {}
  for field in pairs(d) do args[#args + 1] = field end
  for a = 1, #args, PER_CALL do
    redis.call('HDEL', key, unpack(args, a, math.min(a + PER_CALL - 1, #args)))
  end
end
for key, n in pairs(counted) do redis.call('HINCRBY', key, 'n', n) end
for key in pairs(touched) do redis.call('PEXPIRE', key, ttl) end
if top then
  local hwm = tonumber(redis.call('HGET', meta, 'hwm') or '-inf')
  if top > hwm then
    redis.call('HSET', meta, 'hwm', string.format('%.17g', top))
    redis.call('PEXPIRE', meta, ttl)
  end
end
return out
