-- Claims' homes in one shard of a spread namespace: the compare-and-sets of the claim protocol
-- (filters/index/claims.py), one per op, in order. KEYS[1]: the shard's meta hash; KEYS[2..]: the slice
-- hashes the ops name (all declared).
-- ARGV: claim TTL (ms), key TTL (ms), the window's horizon (event time), the numbers in KEYS of the live
--       slices (comma-separated), the highest event time the ops create ('' if none: the shard's
--       high-water mark moves to it), the ops' numbers (below), then per op: the id and, for a create or
--       put, the entry, for a note, the noter as <ts: f64 LE><id length: u32 LE><id>, for a memo, the
--       memo. The numbers, per op, little-endian: its code (B: 1 create, 2 note, 3 commit, 4 poll,
--       5 refresh, 6 abort, 7 put, 8 memo: a duplicate's verdict d<id>, written over any), the number of its key in KEYS (H), its event time (d) and, for a commit, how many notes the
--       claimant has seen (I4; else 0). (One argument for all the numbers: an argument costs a string in
--       the Lua VM.)
-- A home is the entry field e<id> and, while the claim is undecided, the state field c<id> =
-- 'Q' <deadline: f64 BE, ms of this node's clock> <the entry's event time: the entry's bytes 2-9> <notes>.
-- Committed: the entry without a state. Gone: neither. (The event time in the state lets a commit, the
-- commonest op, read the state alone: an entry is as long as a message's sketch; it is read only when the
-- state is absent. A state 'P' <deadline> <notes> of an older version is read as the same with its entry's
-- event time.) An id whose entry is live (event time at the horizon or later) in any of the live slices is
-- there already: a create or put of it is a replay ('C', 0), as in the slot layout (the first entry of an
-- id wins); an entry no longer live is written over. The other ops concern the claim of the id at their
-- event time: a home holding another one is gone for them. Returns per op {state ('C', 'P' or 'G'), the
-- entry ('' if not asked for), the notes}; put: 1 (written) or 0 (the id was there already); memo: 1.
local meta = KEYS[1]
local claim_ttl, ttl, horizon, top = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[5])
local live = {}
for k in string.gmatch(ARGV[4], '[^,]+') do live[#live + 1] = KEYS[tonumber(k)] end
local CREATE, NOTE, COMMIT, POLL, REFRESH, ABORT, PUT, MEMO = 1, 2, 3, 4, 5, 6, 7, 8
-- The ops, in columns; and the fields they may read, per key, read at once (a field named by two ops is
-- read twice: the ops of one call are for different ids, but for polls).
local codes, keyed, efs, cfs, tss, args, seens = {}, {}, {}, {}, {}, {}, {}
local names = {}  -- key -> the fields to read there
local timed = false  -- an op needs this node's clock
local commits = false  -- a commit's entry is read after, if its state is absent
local layout = ARGV[6]
local n, i, at = 0, 7, 1
while at <= #layout do
  local code, k, ts, seen
  code, k, ts, seen, at = struct.unpack('<BHdI4', layout, at)
  local id = ARGV[i]
  local key = KEYS[k]
  n = n + 1
  codes[n], keyed[n], tss[n], seens[n] = code, key, ts, seen
  if code == MEMO then  -- nothing to read
    efs[n], args[n] = 'd' .. id, ARGV[i + 1]
    i = i + 2
  else
    local ef, cf = 'e' .. id, 'c' .. id
    efs[n], cfs[n] = ef, cf
    local creates = code == CREATE or code == PUT
    if creates or code == NOTE then args[n] = ARGV[i + 1]; i = i + 2 else i = i + 1 end
    timed = timed or code == CREATE or code == REFRESH or code == POLL
    local l = names[key]
    if not l then l = {}; names[key] = l end
    if code == COMMIT then
      commits = true
    else
      l[#l + 1] = ef
    end
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
end
local now, fresh = 0, nil  -- this node's clock (ms); a pending state with a fresh deadline
if timed then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  fresh = 'Q' .. struct.pack('>d', now + claim_ttl)
end
local COMMITTED, PENDING, GONE = {'C', '', ''}, {'P', '', ''}, {'G', '', ''}  -- the replies without data
local PER_CALL = FIELDS_PER_CALL
-- How many notes a claim's state holds (each: its event time, a length and that many bytes).
local function notes_in(notes)
  local count, p = 0, 1
  while p <= #notes do
    local _, n = struct.unpack('<dI4', notes, p)
    p = p + 12 + n
    count = count + 1
  end
  return count
end
-- The namespace's high-water mark of event time moves up to `top` (ARGV[5]), if given.
local function raise_hwm()
  if not top then return end
  local hwm = tonumber(redis.call('HGET', meta, 'hwm') or '-inf')
  if top > hwm then
    redis.call('HSET', meta, 'hwm', string.format('%.17g', top))
    redis.call('PEXPIRE', meta, ttl)
  end
end
-- A hash's fields read into `v` (field -> value, false: absent), written and deleted, PER_CALL fields a command.
local function read_into(key, fields, v)
  for a = 1, #fields, PER_CALL do
    local b = math.min(a + PER_CALL - 1, #fields)
    local got = redis.call('HMGET', key, unpack(fields, a, b))
    for j = a, b do v[fields[j]] = got[j - a + 1] end
  end
end
local function write_pairs(key, flat)  -- field, value, field, value, ...
  for a = 1, #flat, 2 * PER_CALL do
    redis.call('HSET', key, unpack(flat, a, math.min(a + 2 * PER_CALL - 1, #flat)))
  end
end
local function delete_fields(key, fields)
  for a = 1, #fields, PER_CALL do
    redis.call('HDEL', key, unpack(fields, a, math.min(a + PER_CALL - 1, #fields)))
  end
end
local val = {}  -- key -> field -> value (false: absent), as the ops leave them
for key, l in pairs(names) do
  local v = {}
  read_into(key, l, v)
  val[key] = v
end
if commits then  -- the entries of the commits whose state is absent (committed, or gone)
  local again = {}
  for o = 1, n do
    local key = keyed[o]
    local c = codes[o] == COMMIT and val[key][cfs[o]]
    if codes[o] == COMMIT and (not c or string.byte(c) == 80) then  -- absent, or of an older version ('P')
      local l = again[key]
      if not l then l = {}; again[key] = l end
      l[#l + 1] = efs[o]
    end
  end
  for key, l in pairs(again) do read_into(key, l, val[key]) end
end
for o = 1, n do  -- a state of an older version ('P' <deadline> <notes>) as this one's
  local cf = cfs[o]
  local v = cf and val[keyed[o]]
  local c = v and v[cf]
  if c and string.byte(c) == 80 then
    local e = v[efs[o]]
    v[cf] = e and 'Q' .. string.sub(c, 2, 9) .. string.sub(e, 2, 9) .. string.sub(c, 10)
  end
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
-- The commonest call, the creates of a round (with the memos of its insert) of distinct ids, without the
-- general bookkeeping below (the same outcome).
local fast = not commits
local ids = {}  -- the ids' entry fields met so far: a call that names one twice takes the general way
for o = 1, fast and n or 0 do
  local code = codes[o]
  if code == CREATE then
    local ef = efs[o]
    if ids[ef] then fast = false; break end
    ids[ef] = true
  elseif code ~= MEMO then
    fast = false
    break
  end
end
if fast then
  local writes, memos, out = {}, {}, {}
  for o = 1, n do
    local key, ef, arg = keyed[o], efs[o], args[o]
    local w = writes[key]
    if not w then w = {}; writes[key] = w end
    if codes[o] == MEMO then
      w[#w + 1] = ef
      w[#w + 1] = arg
      memos[key] = (memos[key] or 0) + 1
      out[o] = 1
    else
      local here, cf = val[key], cfs[o]
      local e, c = here[ef], here[cf]
      if e and struct.unpack('<d', e, 2) < horizon then e, c = false, false end  -- left the window: as if absent
      if c then  -- taken over: a fresh deadline, the rest stays
        w[#w + 1] = cf
        w[#w + 1] = fresh .. string.sub(c, 10)
        out[o] = {'P', '', string.sub(c, 18)}
      else
        if e or elsewhere(key, ef) then
          out[o] = COMMITTED  -- committed already: a replay
        else
          w[#w + 1] = ef
          w[#w + 1] = arg
          w[#w + 1] = cf
          w[#w + 1] = fresh .. string.sub(arg, 2, 9)
          out[o] = PENDING
        end
      end
    end
  end
  for key, w in pairs(writes) do
    if #w > 0 then
      write_pairs(key, w)
      redis.call('PEXPIRE', key, ttl)
    end
  end
  for key, m in pairs(memos) do redis.call('HINCRBY', key, 'm', m) end
  raise_hwm()
  return out
end
-- ... and the commits of a round (distinct ids): the state alone decides, read above (the entry too if absent).
local only = commits
if only then
  for o = 1, n do
    local ef = efs[o]
    if codes[o] ~= COMMIT or ids[ef] then only = false; break end
    ids[ef] = true
  end
end
if only then
  local drops, out = {}, {}
  for o = 1, n do
    local key, ts = keyed[o], tss[o]
    local here = val[key]
    local c = here[cfs[o]]
    if c then
      if struct.unpack('<d', c, 10) ~= ts then
        out[o] = GONE  -- another claim of the id
      else
        local notes = string.sub(c, 18)
        if notes_in(notes) <= seens[o] then
          local d = drops[key]
          if not d then d = {}; drops[key] = d end
          d[#d + 1] = cfs[o]
          out[o] = COMMITTED
        else
          out[o] = {'P', '', notes}
        end
      end
    else
      local e = here[efs[o]]
      out[o] = (e and struct.unpack('<d', e, 2) == ts) and COMMITTED or GONE
    end
  end
  for key, d in pairs(drops) do
    delete_fields(key, d)
    redis.call('HINCRBY', key, 'n', #d)
  end
  return out
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
local out = {}
local memos = {}  -- key -> memos written there
for o = 1, n do
  local code, key, ef, cf, ts, arg = codes[o], keyed[o], efs[o], cfs[o], tss[o], args[o]
  if code == MEMO then  -- a field no op reads: written, not kept in `val`
    local s = set[key]
    if not s then s = {}; set[key] = s end
    s[ef] = arg
    memos[key] = (memos[key] or 0) + 1
    touched[key] = true
    out[o] = 1
  else
    local here = val[key]
    local e, c = here[ef], here[cf]
    local creates = code == CREATE or code == PUT
    if code == COMMIT and c then
      -- The state alone was read: its event time says whose claim it is.
      if struct.unpack('<d', c, 10) ~= ts then c = false end
      e = c and true
    elseif e then
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
        put(key, cf, fresh .. string.sub(arg, 2, 9))
        touched[key] = true
        reply = PENDING
      else
        reply = GONE
      end
    else
      local deadline = struct.unpack('>d', c, 2)
      local notes = string.sub(c, 18)
      if code == CREATE or code == REFRESH then  -- taken over / kept alive: a fresh deadline, the rest stays
        put(key, cf, fresh .. string.sub(c, 10))
        touched[key] = true
        reply = {'P', '', notes}
      elseif code == NOTE then
        notes = notes .. arg
        put(key, cf, string.sub(c, 1, 17) .. notes)
        reply = {'P', e, notes}
      elseif code == COMMIT then
        if notes_in(notes) <= seens[o] then
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
    out[o] = reply
  end
end
for key, s in pairs(set) do
  local args = {}
  for field, value in pairs(s) do args[#args + 1] = field; args[#args + 1] = value end
  write_pairs(key, args)
end
for key, d in pairs(del) do
  local args = {}
  for field in pairs(d) do args[#args + 1] = field end
  delete_fields(key, args)
end
for key, n in pairs(counted) do redis.call('HINCRBY', key, 'n', n) end
for key, n in pairs(memos) do redis.call('HINCRBY', key, 'm', n) end
for key in pairs(touched) do redis.call('PEXPIRE', key, ttl) end
raise_hwm()
return out
