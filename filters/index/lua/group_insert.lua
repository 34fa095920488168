-- One caller's insert round in the group layout, atomically (insert_slices.lua and round_start.lua come before this):
-- compact_insert.lua's checks and writes, the records in groups of the slice hash (docs/design.md, "The group
-- layout"; the stored forms are group_codec.py's, and what this writes is its `apply_round`'s).
-- KEYS[1]: the namespace's meta hash.
-- ARGV: slice key prefix, window, slice length, bucket cap, TTL (ms), the caller's high-water mark of
--       event time, the slices the caller read (comma-separated, in the order of its tails), the seq at its
--       lookup and how many it inserted since, the window's clock ('' for the high-water mark), the marker
--       the caller's lookup read ('' for no check), a token that names the namespace if this call makes it
--       (`gen`), the entries a slice is expected to hold (the `rate` option's; 0 for none), then per entry:
--       id, event time, encoded entry, the number n of its buckets, what the caller saw of them (per slice it
--       read, the seq of each bucket's newest record, zeros if absent; '' for no check), and the mixed values
--       of its id's FNV-1a hash and of its n bucket keys (8 bytes big-endian each: the key times
--       0x9E3779B97F4A7C15 mod 2^64, whose top k bits are the group and low 32 bits the records' key).
-- Returns {seq, high-water mark, per entry: its seq (inserted), 0 (its id is live, or it is outside the
--          window) or -1 (a bucket changed since the caller saw it: not inserted)}, {-1, '', {}} when the
--          marker is not the caller's, {-2, '', {}} when the namespace is of another layout: nothing written.
local SIZE, TAG, TWO32 = 20, 2147483648, 4294967296
local K_FIRST, K_MIN, K_MAX, PER_ENTRY, FILL = GROUP_BITS
local find, sub, byte, floor, unpack_ = string.find, string.sub, string.byte, math.floor, struct.unpack
-- Every slice's buckets are read only to be compared: when some entry has tails to compare, and others wrote.
local compare = false
if not alone then
  for _, e in ipairs(entries) do
    if ARGV[e[1] + 4] ~= '' then compare = true end
  end
end
local names_of = {}  -- group number -> its field name (made once: Lua hashes every string it makes)
local function group_field(g)
  local f = names_of[g]
  if f == nil then f = 'g' .. string.format('%d', g); names_of[g] = f end
  return f
end
-- The group (a number) of the j-th mixed value (from 0) of an entry's argument m, in a slice of b bits.
local function group_of(m, j, b)
  return floor(unpack_('>I4', m, 8 * j + 1) / 2 ^ (32 - b))
end
-- The places (from 1) of the records of key `key` in group g, an id's (`tagged`) or a bucket's: found by a
-- plain search (the 4 bytes at a record's start only), most records never looked at from Lua.
local function places(g, key, tagged)
  local out, init = {}, 1
  while true do
    local p = find(g, key, init, true)
    if p == nil then return out end
    if (p - 1) % SIZE == 0 then
      if (byte(g, p + 12) >= 128) == tagged then out[#out + 1] = p end
      init = p + SIZE
    else
      init = p + 1
    end
  end
end
local function count(g, key) return #places(g, key, false) end  -- the records of bucket `key` in group g
local function seq_at(g, p)  -- the seq of the record at place p of group g, its tag cleared
  local hi, lo = unpack_('>I4>I4', g, p + 12)
  if hi >= TAG then hi = hi - TAG end
  return hi * TWO32 + lo
end
-- The groups each slice holds of what this call needs (group number -> value): every id's and, when comparing,
-- every bucket's (else only the buckets' of the slice each entry goes to).
local orig = {}
for _, s in ipairs(slices) do
  local o = {}
  local b = bits[s]
  if b ~= nil then
    local wanted, seen, div = {}, {}, 2 ^ (32 - b)
    for _, e in ipairs(entries) do
      local m, n = ARGV[e[1] + 5], e[3]
      local last = (compare or s == floor(e[2] / slice_len)) and n or 0
      for j = 0, last do
        local g = floor(unpack_('>I4', m, 8 * j + 1) / div)
        if not seen[g] then seen[g] = true; wanted[#wanted + 1] = g end
      end
    end
    for a = 1, #wanted, PER_CALL do
      local part, names = {}, {}
      for j = a, math.min(a + PER_CALL - 1, #wanted) do
        part[#part + 1] = wanted[j]
        names[#names + 1] = group_field(wanted[j])
      end
      local values = redis.call('HMGET', big(s), unpack(names))
      for j = 1, #part do
        if values[j] then o[part[j]] = values[j] end
      end
    end
  end
  orig[s] = o
end
-- A bucket's records in g cut to the cap newest (event time, then seq; the first written first among equals),
-- every other record and the order kept: group_codec.trim_bucket.
local function trim(g, key)
  local mine = {}
  for _, p in ipairs(places(g, key, false)) do mine[#mine + 1] = {unpack_('<d', g, p + 4), seq_at(g, p), p} end
  if #mine <= cap then return g end
  table.sort(mine, function(x, y)
    if x[1] ~= y[1] then return x[1] > y[1] end
    if x[2] ~= y[2] then return x[2] > y[2] end
    return x[3] < y[3]
  end)
  local dropped = {}
  for j = cap + 1, #mine do dropped[mine[j][3]] = true end
  local out = {}
  for p = 1, #g, SIZE do
    if not dropped[p] then out[#out + 1] = sub(g, p, p + SIZE - 1) end
  end
  return table.concat(out)
end
-- What this call writes, per slice: per group written {its value as it stands but the records appended since,
-- those records, its buckets' counts of records (counted once, then kept)}; the groups in the order first
-- written; the entries' fields and values.
local written, order, entries_of = {}, {}, {}
local function joined(w)  -- the whole group of a written group's state (one string made: Lua hashes each whole)
  local a = w[2]
  if #a > 0 then
    table.insert(a, 1, w[1])
    w[1] = table.concat(a)
    w[2] = {}
  end
  return w[1]
end
-- The id stored at the end of entry e<seq> of slice s; nil when there is none.
local function entry_id(s, seq_number)
  local v = redis.call('HGET', big(s), 'e' .. struct.pack('>I8', seq_number))
  if not v or #v < 2 then return nil end
  local len = unpack_('<I2', v, #v - 1)
  return sub(v, #v - 1 - len, #v - 2)
end
-- Whether an id (m: its entry's mixed values, the id's first) has a record inside the window: one this call
-- wrote, or one read in a slice whose entry is the id's (another id alike in its 32 bits and group is not it).
local written_at = {}  -- id -> the newest event time this call wrote it at
local function live(id, m)
  local horizon = hwm - window
  local mine = written_at[id]
  if mine ~= nil and mine >= horizon then return true end
  local key = sub(m, 5, 8)
  for _, s in ipairs(slices) do
    local b = bits[s]
    local g = b and orig[s][group_of(m, 0, b)]
    if g and find(g, key, 1, true) then
      for _, p in ipairs(places(g, key, true)) do
        if unpack_('<d', g, p + 4) >= horizon and entry_id(s, seq_at(g, p)) == id then return true end
      end
    end
  end
  return false
end
-- The seq (8 bytes) of a bucket's last record in group g, as read: what the caller's tails name.
local function tail(g, key)
  local at = places(g, key, false)
  if #at == 0 then return ABSENT end
  return sub(g, at[#at] + 12, at[#at] + 19)
end
local results, added = {}, {}
for _, e in ipairs(entries) do
  local at, ts, n = e[1], e[2], e[3]
  local id, blob, tails, m = ARGV[at], ARGV[at + 2], ARGV[at + 4], ARGV[at + 5]
  local result = 0
  if not live(id, m) then
    if ts > hwm then hwm = ts end
    if ts >= hwm - window then
      if tails ~= '' and not alone and buckets_moved(tails, n, slices, seen_at, function(s, j)
        local b = bits[s]
        local g = b and orig[s][group_of(m, j, b)]
        return g and tail(g, sub(m, 8 * j + 5, 8 * j + 8)) or ABSENT
      end) then result = -1 end
      if result == 0 then
        seq = seq + 1
        local seq_bytes = struct.pack('>I8', seq)
        local s = floor(ts / slice_len)
        if bits[s] == nil then  -- the slice's first write: groups for the rate of the slice before (or expected)
          local prev = tonumber(redis.call('HGET', big(s - 1), 'n') or '')
          local function bits_for(entries_expected)
            local groups = math.ceil(math.max(0, entries_expected) * PER_ENTRY / FILL)
            local k = 0
            while 2 ^ k < groups do k = k + 1 end
            return math.min(K_MAX, math.max(K_MIN, k))
          end
          local b = prev and bits_for(prev) or K_FIRST
          b = math.max(b, bits_for(expected))
          bits[s] = b
          redis.call('HSET', meta, 'k:' .. string.format('%d', s), b)
        end
        local b = bits[s]
        local ws, os, o = written[s], order[s], orig[s]
        if ws == nil then ws, os = {}, {}; written[s], order[s], entries_of[s] = ws, os, {} end
        local rec = struct.pack('<d', ts) .. seq_bytes
        local div = 2 ^ (32 - b)
        for j = 1, n do
          local g = floor(unpack_('>I4', m, 8 * j + 1) / div)
          local w = ws[g]
          if w == nil then w = {o[g] or '', {}, {}}; ws[g] = w; os[#os + 1] = g end
          local key = sub(m, 8 * j + 5, 8 * j + 8)
          local counts = w[3]
          local c = counts[key]
          -- (none of its records among those appended here yet: they would have counted it)
          if c == nil then c = w[1] == '' and 0 or count(w[1], key) end
          if c > 2 * cap then
            w[1] = trim(joined(w), key)
            c = cap
          end
          local a = w[2]
          a[#a + 1] = key
          a[#a + 1] = rec
          counts[key] = c + 1
        end
        local g = group_of(m, 0, b)
        local w = ws[g]
        if w == nil then w = {o[g] or '', {}, {}}; ws[g] = w; os[#os + 1] = g end
        local a = w[2]
        a[#a + 1] = sub(m, 5, 8) .. struct.pack('<d>I4>I4', ts, floor(seq / TWO32) + TAG, seq % TWO32)
        if (written_at[id] or -math.huge) < ts then written_at[id] = ts end
        local es = entries_of[s]
        es[#es + 1] = 'e' .. seq_bytes
        es[#es + 1] = blob .. id .. struct.pack('<I2', #id)
        added[s] = (added[s] or 0) + 1
        result = seq
      end
    end
  end
  results[#results + 1] = result
end
for _, s in ipairs(slices) do
  if added[s] then
    local key, args, ws = big(s), entries_of[s], written[s]
    for _, g in ipairs(order[s]) do
      args[#args + 1] = group_field(g)
      args[#args + 1] = joined(ws[g])
    end
    hset_pairs(key, args)
    redis.call('HINCRBY', key, 'n', added[s])
    redis.call('PEXPIRE', key, ttl)
  end
end
local hwm_s = state[2] or ''
if hwm > stored_hwm then
  hwm_s = string.format('%.17g', hwm)
  redis.call('HSET', meta, 'hwm', hwm_s)
end
if seq > start then
  redis.call('HSET', meta, 'seq', string.format('%d', seq), 'layout', 'group')
  redis.call('HSETNX', meta, 'gen', ARGV[12])
  local clock = hwm
  if ARGV[10] ~= '' then clock = tonumber(ARGV[10]) end
  local gone = floor((clock - window) / slice_len) - 1
  redis.call('UNLINK', big(gone))
  redis.call('HDEL', meta, 'k:' .. string.format('%d', gone))
end
if seq > start or hwm > stored_hwm then redis.call('PEXPIRE', meta, ttl) end
return {seq, hwm_s, results}
