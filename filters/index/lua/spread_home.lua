-- Claims' homes in one shard of a spread namespace: the compare-and-sets of the claim protocol
-- (filters/index/claims.py), one per op, in order. KEYS[1]: the shard's meta hash; KEYS[2..]: the live
-- slices' hashes, then the other slice hashes the ops name (all declared).
-- ARGV: claim TTL (ms), key TTL (ms), the window's horizon (event time), how many live slices KEYS holds
--       (after the meta hash), the highest event time the ops create ('' if none: the shard's high-water
--       mark moves to it), the ops' numbers (below), then per op: the id and, for a create or put, the
--       entry, for a note, the noter as <ts: f64 LE><id length: u32 LE><id>, for a memo, the memo. The
--       numbers, per op, little-endian: its code (B: 1 create, 2 note, 3 commit, 4 poll, 5 refresh, 6 abort,
--       7 put, 8 memo: a duplicate's verdict d<id>, written over any), the number of its key in KEYS (H),
--       its event time (d) and, for a commit, how many notes the claimant has seen (I4; else 0). (One
--       argument for all the numbers: an argument costs a string in the Lua VM.)
-- A home is the entry field e<id> and, while the claim is undecided, the state field c<id> =
-- 'Q' <deadline: f64 BE, ms of this node's clock> <the entry's event time: the entry's bytes 2-9> <notes>.
-- Committed: the entry without a state. Gone: neither. (The event time in the state lets a commit, the
-- commonest op, read the state alone: an entry is as long as a message's sketch; it is read only when the
-- state is absent. A state 'P' <deadline> <notes> of an older version is read as the same with its entry's
-- event time.) An id whose entry is live (event time at the horizon or later) in any of the live slices is
-- there already: a create or put of it is a replay ('C', 0), as in the slot layout (the first entry of an
-- id wins); an entry no longer live is written over. The other ops concern the claim of the id at their
-- event time: a home holding another one is gone for them. Returns one flat list, per op in order: three
-- values, its state ('C', 'P' or 'G'), the entry ('' if not asked for) and the notes; a put one, 1 (written)
-- or 0 (the id was there already); a memo one, 1. (Flat: Redis converts each table of a script's reply
-- with several lookups of its own; one table a call is converted once.)
-- The commonest calls, the creates of a round with the memos of its insert and the commits of a round (of
-- distinct ids), each take a short way: one pass to tell them, one to name the fields, one to decide, few
-- tables (a table that grows is rehashed at each doubling). Others take the general way (the same outcomes).
local meta = KEYS[1]
local claim_ttl, ttl, horizon, top = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[5])
local nlive = tonumber(ARGV[4])  -- the live slices are KEYS[2 .. 1 + nlive]
local layout = ARGV[6]
local size = #layout
local CREATE, NOTE, COMMIT, POLL, REFRESH, ABORT, PUT, MEMO = 1, 2, 3, 4, 5, 6, 7, 8
local PER_CALL = FIELDS_PER_CALL
local unpack_, sub, byte = struct.unpack, string.sub, string.byte
local OP = 15  -- the bytes of an op's numbers (read with string.byte where they are bytes: struct.unpack
               -- parses its format at every call)
-- How many notes a claim's state holds (each: its event time, a length and that many bytes).
local function notes_in(notes)
  local count, p = 0, 1
  while p <= #notes do
    local _, n = unpack_('<dI4', notes, p)
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
-- A hash's fields read (a list: value or false), written and deleted, PER_CALL fields a command.
local function read_list(key, fields, count)
  if count <= PER_CALL then return redis.call('HMGET', key, unpack(fields, 1, count)) end
  local out = {}
  for a = 1, count, PER_CALL do
    local b = math.min(a + PER_CALL - 1, count)
    local got = redis.call('HMGET', key, unpack(fields, a, b))
    for j = a, b do out[j] = got[j - a + 1] end
  end
  return out
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
local function upgraded(c, e)  -- an older state ('P' <deadline> <notes>) as this one's, with its entry `e`'s time
  return e and 'Q' .. sub(c, 2, 9) .. sub(e, 2, 9) .. sub(c, 10)
end
local function fresh_state()  -- 'Q' and a deadline claim_ttl ahead of this node's clock (ms)
  local t = redis.call('TIME')
  return 'Q' .. struct.pack('>d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + claim_ttl), t
end
-- Which way: creates and memos only (the creates of distinct ids), commits only (of distinct ids), or other.
local creating, committing = true, true
do
  local ids, i, at = {}, 7, 1
  while at <= size do
    local code = byte(layout, at)
    at = at + OP
    if code == CREATE or code == COMMIT then
      local id = ARGV[i]
      if ids[id] then creating, committing = false, false else ids[id] = true end
      if code == CREATE then committing = false else creating = false end
    elseif code ~= MEMO then
      creating, committing = false, false
    else
      committing = false
    end
    i = i + ((code == COMMIT or code == POLL or code == REFRESH or code == ABORT) and 1 or 2)
    if not (creating or committing) then break end
  end
end
if creating then
  -- Every create's entry and state fields, read in each live slice and in its own: its own says whether
  -- the id is there (or pending), the others whether it is live elsewhere.
  local fields, count, own = {}, 0, {}
  local i, at = 7, 1
  while at <= size do
    local code, k1, k2 = byte(layout, at, at + 2)
    local k = k1 + 256 * k2
    at = at + OP
    if code == CREATE then
      local id = ARGV[i]
      fields[count + 1], fields[count + 2] = 'e' .. id, 'c' .. id
      count = count + 2
      if k > 1 + nlive then own[k] = true end
    end
    i = i + 2
  end
  local got = {}
  if count > 0 then
    for k = 2, 1 + nlive do got[k] = read_list(KEYS[k], fields, count) end
    for k in pairs(own) do got[k] = read_list(KEYS[k], fields, count) end
  end
  local fresh = count > 0 and fresh_state()
  local out, n = {}, 0
  local writes, memos = {}, {}  -- key number -> field, value, ...; key number -> memos written there
  local p = 1  -- the place of the create's entry field in `fields`
  i, at = 7, 1
  while at <= size do
    local code, k1, k2 = byte(layout, at, at + 2)
    local k = k1 + 256 * k2
    at = at + OP
    local arg = ARGV[i + 1]
    local w = writes[k]
    if not w then w = {}; writes[k] = w end
    if code == MEMO then
      w[#w + 1] = 'd' .. ARGV[i]
      w[#w + 1] = arg
      memos[k] = (memos[k] or 0) + 1
      n = n + 1
      out[n] = 1
    else
      local here = got[k]
      local e, c = here[p], here[p + 1]
      if c and byte(c) == 80 then  -- a state of an older version ('P' <deadline> <notes>) as this one's
        c = upgraded(c, e)
      end
      if e and unpack_('<d', e, 2) < horizon then e, c = false, false end  -- left the window: as if absent
      local there = e
      if not (c or e) then  -- a live entry of the id in another of the live slices
        for other = 2, 1 + nlive do
          local o = other ~= k and got[other][p]
          if o and unpack_('<d', o, 2) >= horizon then there = true; break end
        end
      end
      if c then  -- taken over: a fresh deadline, the rest stays
        w[#w + 1] = fields[p + 1]
        w[#w + 1] = fresh .. sub(c, 10)
        out[n + 1], out[n + 2], out[n + 3] = 'P', '', sub(c, 18)
      elseif there then
        out[n + 1], out[n + 2], out[n + 3] = 'C', '', ''  -- committed already: a replay
      else
        w[#w + 1] = fields[p]
        w[#w + 1] = arg
        w[#w + 1] = fields[p + 1]
        w[#w + 1] = fresh .. sub(arg, 2, 9)
        out[n + 1], out[n + 2], out[n + 3] = 'P', '', ''
      end
      n = n + 3
      p = p + 2
    end
    i = i + 2
  end
  for k, w in pairs(writes) do
    if #w > 0 then
      write_pairs(KEYS[k], w)
      redis.call('PEXPIRE', KEYS[k], ttl)
    end
  end
  for k, m in pairs(memos) do redis.call('HINCRBY', KEYS[k], 'm', m) end
  raise_hwm()
  return out
end
if committing then
  -- Every commit's state field, read in each slice the commits name: the state alone decides (its event
  -- time names its claim); the entry is read where it is absent (committed, or gone) or of an older version.
  local fields, count, keys = {}, 0, {}
  local i, at = 7, 1
  while at <= size do
    local k1, k2 = byte(layout, at + 1, at + 2)
    at = at + OP
    count = count + 1
    fields[count] = 'c' .. ARGV[i]
    keys[k1 + 256 * k2] = true
    i = i + 1
  end
  local got = {}
  for k in pairs(keys) do got[k] = read_list(KEYS[k], fields, count) end
  local out, drops = {}, {}  -- drops: key number -> the states deleted there
  local function decide(o, k, ts, seen, c)
    local n = 3 * o - 2
    if not c then
      out[n], out[n + 1], out[n + 2] = 'G', '', ''
    elseif unpack_('<d', c, 10) ~= ts then
      out[n], out[n + 1], out[n + 2] = 'G', '', ''  -- another claim of the id
    else
      local notes = sub(c, 18)
      if notes_in(notes) <= seen then
        local d = drops[k]
        if not d then d = {}; drops[k] = d end
        d[#d + 1] = fields[o]
        out[n], out[n + 1], out[n + 2] = 'C', '', ''
      else
        out[n], out[n + 1], out[n + 2] = 'P', '', notes
      end
    end
  end
  i, at = 7, 1
  for o = 1, count do
    local k1, k2 = byte(layout, at + 1, at + 2)
    local k = k1 + 256 * k2
    local ts, seen = unpack_('<dI4', layout, at + 3)
    at = at + OP
    local c = got[k][o]
    if c and byte(c) ~= 80 then
      decide(o, k, ts, seen, c)
    else  -- absent, or of an older version ('P'): its entry is read
      local e = redis.call('HGET', KEYS[k], 'e' .. ARGV[i])
      if c then
        decide(o, k, ts, seen, upgraded(c, e))
      else
        local n = 3 * o - 2
        out[n] = (e and unpack_('<d', e, 2) == ts) and 'C' or 'G'
        out[n + 1], out[n + 2] = '', ''
      end
    end
    i = i + 1
  end
  for k, d in pairs(drops) do
    delete_fields(KEYS[k], d)
    redis.call('HINCRBY', KEYS[k], 'n', #d)
  end
  return out
end
-- The general way: every op in order, each seeing what the ops before it left.
local live = {}
for k = 2, 1 + nlive do live[#live + 1] = KEYS[k] end
local codes, keyed, efs, cfs, tss, args, seens = {}, {}, {}, {}, {}, {}, {}
local names = {}  -- key -> the fields to read there
local timed = false  -- an op needs this node's clock
local commits = false  -- a commit's entry is read after, if its state is absent
local n, i, at = 0, 7, 1
while at <= size do
  local code, k, ts, seen
  code, k, ts, seen, at = unpack_('<BHdI4', layout, at)
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
  local t
  fresh, t = fresh_state()
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local COMMITTED, PENDING, GONE = {'C', '', ''}, {'P', '', ''}, {'G', '', ''}  -- the replies without data
local function read_into(key, fields, v)  -- `v`: field -> value (false: absent)
  local got = read_list(key, fields, #fields)
  for j = 1, #fields do v[fields[j]] = got[j] end
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
    if codes[o] == COMMIT and (not c or byte(c) == 80) then  -- absent, or of an older version ('P')
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
  if c and byte(c) == 80 then
    local e = v[efs[o]]
    v[cf] = upgraded(c, e)
  end
end
local function elsewhere(key, ef)  -- a live entry of the id in another of the live slices
  for _, other in ipairs(live) do
    if other ~= key then
      local e = val[other][ef]
      if e and unpack_('<d', e, 2) >= horizon then return true end
    end
  end
  return false
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
      if unpack_('<d', c, 10) ~= ts then c = false end
      e = c and true
    elseif e then
      local at = unpack_('<d', e, 2)
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
        put(key, cf, fresh .. sub(arg, 2, 9))
        touched[key] = true
        reply = PENDING
      else
        reply = GONE
      end
    else
      local deadline = unpack_('>d', c, 2)
      local notes = sub(c, 18)
      if code == CREATE or code == REFRESH then  -- taken over / kept alive: a fresh deadline, the rest stays
        put(key, cf, fresh .. sub(c, 10))
        touched[key] = true
        reply = {'P', '', notes}
      elseif code == NOTE then
        notes = notes .. arg
        put(key, cf, sub(c, 1, 17) .. notes)
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
local flat, m = {}, 0
for o = 1, n do
  local r = out[o]
  if type(r) == 'table' then
    flat[m + 1], flat[m + 2], flat[m + 3] = r[1], r[2], r[3]
    m = m + 3
  else
    m = m + 1
    flat[m] = r
  end
end
return flat
