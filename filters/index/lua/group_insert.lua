-- One caller's insert round in the group layout, atomically (insert_slices.lua comes before this):
-- compact_insert.lua's checks and writes, the records in groups of the slice hash (docs/design.md, "The group
-- layout"; the stored forms are group_codec.py's, and what this writes is its `apply_round`'s).
-- KEYS[1]: the namespace's meta hash.
-- ARGV: slice key prefix, window, slice length, bucket cap, TTL (ms), the caller's high-water mark of
--       event time, the slices the caller read (comma-separated, in the order of its tails), the seq at its
--       lookup and how many it inserted since, the window's clock ('' for the high-water mark), the marker
--       the caller's lookup read ('' for no check), a token that names the namespace if this call makes it
--       (`gen`), the entries a slice is expected to hold (the `rate` option's; 0 for none), then per entry:
--       id, event time, encoded entry, the number n of its buckets, what the caller saw of them (per slice it
--       read, the seq of each bucket's newest record, zeros if absent; '' for no check), the mixed value of its
--       id's FNV-1a hash (8 bytes big-endian: its key times 0x9E3779B97F4A7C15 mod 2^64, whose top k bits are
--       the group and low 32 bits the record's key), then those of its n bucket keys.
-- Returns {seq, high-water mark, per entry: its seq (inserted), 0 (its id is live, or it is outside the
--          window) or -1 (a bucket changed since the caller saw it: not inserted)}, {-1, '', {}} when the
--          marker is not the caller's, {-2, '', {}} when the namespace is of another layout: nothing written.
local meta, spre = KEYS[1], ARGV[1]
local window, slice_len, cap, ttl = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local hwm = tonumber(ARGV[6])
local ABSENT = string.rep('\0', 8)
local SIZE, TAG, TWO32 = 20, 2147483648, 4294967296
local K_FIRST, K_MIN, K_MAX, PER_ENTRY, FILL = GROUP_BITS
local FIRST, PER_CALL = 14, FIELDS_PER_CALL
local expected = tonumber(ARGV[13])
local state = redis.call('HMGET', meta, 'seq', 'hwm', 'epoch', 'layout')
if ARGV[11] ~= '' and state[3] ~= ARGV[11] then return {-1, '', {}} end
if state[1] and state[4] ~= 'group' then return {-2, '', {}} end
local stored_hwm = tonumber(state[2] or '-inf')
if stored_hwm > hwm then hwm = stored_hwm end
local start = tonumber(state[1] or '0')
local seq = start
local alone = start == tonumber(ARGV[8]) + tonumber(ARGV[9])
local entries, slices, seen_at, read_all = insert_slices(FIRST, 6, hwm, window, slice_len)
-- A round whose event times all come after the high-water mark (a restore's: no lookup raised the caller's)
-- finds its first entries' live ids inside the window of that mark: its slices too (records are never newer
-- than the mark, so the slices in between hold nothing).
if hwm > -math.huge then
  local low = {}
  for s = math.floor((hwm - window) / slice_len), math.min(math.floor(hwm / slice_len), slices[1] - 1) do
    low[#low + 1] = s
    if not seen_at[s] then read_all = false end
  end
  for _, s in ipairs(slices) do low[#low + 1] = s end
  slices = low
end
if not read_all then alone = false end
-- Every slice's buckets are read only to be compared: when some entry has tails to compare, and others wrote.
local compare = false
if not alone then
  for _, e in ipairs(entries) do
    if ARGV[e[1] + 4] ~= '' then compare = true end
  end
end
-- The bits of each slice (nil: nothing written there yet).
local bits = {}
do
  local names = {}
  for j, s in ipairs(slices) do names[j] = 'k:' .. string.format('%d', s) end
  local ks = redis.call('HMGET', meta, unpack(names))
  for j, s in ipairs(slices) do bits[s] = tonumber(ks[j]) end
end
local function big(s) return spre .. string.format('%d', s) end
-- The group field of a mixed value (8 bytes) in a slice of b bits, and the key its records carry.
local function group_of(m, b)
  return 'g' .. string.format('%d', math.floor(struct.unpack('>I4', m, 1) / 2 ^ (32 - b)))
end
local function seq_of(r, g)  -- the seq of record r (from 0) of group g, its tag cleared
  local hi, lo = struct.unpack('>I4>I4', g, r * SIZE + 13)
  if hi >= TAG then hi = hi - TAG end
  return hi * TWO32 + lo
end
-- The groups each slice holds of what this call needs: every id's and, when comparing, every bucket's
-- (else only the buckets' of the slice each entry goes to).
local orig, cur, dirty, order = {}, {}, {}, {}
for _, s in ipairs(slices) do
  local o = {}
  local b = bits[s]
  if b ~= nil then
    local names, seen = {}, {}
    local function want(m)
      local f = group_of(m, b)
      if not seen[f] then seen[f] = true; names[#names + 1] = f end
    end
    for _, e in ipairs(entries) do
      local at, n = e[1], e[3]
      want(ARGV[at + 5])
      if compare or s == math.floor(e[2] / slice_len) then
        for j = at + 6, at + 5 + n do want(ARGV[j]) end
      end
    end
    for a = 1, #names, PER_CALL do
      local part = {unpack(names, a, math.min(a + PER_CALL - 1, #names))}
      local values = redis.call('HMGET', big(s), unpack(part))
      for j = 1, #part do o[part[j]] = values[j] or nil end
    end
  end
  orig[s], cur[s], dirty[s], order[s] = o, {}, {}, {}
end
local function now(s, f)
  local v = cur[s][f]
  if v == nil then v = orig[s][f] end
  return v or ''
end
local function put(s, f, v)
  cur[s][f] = v
  if not dirty[s][f] then dirty[s][f] = true; order[s][#order[s] + 1] = f end
end
-- The seq (8 bytes) of a bucket's last record in group g: what the caller's tails name.
local function tail(g, key)
  local t = ABSENT
  for r = 0, #g / SIZE - 1 do
    local p = r * SIZE
    if string.sub(g, p + 1, p + 4) == key and string.byte(g, p + 13) < 128 then t = string.sub(g, p + 13, p + 20) end
  end
  return t
end
-- A bucket's records in g cut to the cap newest (event time, then seq; the first written first among equals),
-- every other record and the order kept: group_codec.trim_bucket.
local function trim(g, key)
  local mine = {}
  for r = 0, #g / SIZE - 1 do
    local p = r * SIZE
    if string.sub(g, p + 1, p + 4) == key and string.byte(g, p + 13) < 128 then
      mine[#mine + 1] = {struct.unpack('<d', g, p + 5), seq_of(r, g), r}
    end
  end
  if #mine <= cap then return g end
  table.sort(mine, function(x, y)
    if x[1] ~= y[1] then return x[1] > y[1] end
    if x[2] ~= y[2] then return x[2] > y[2] end
    return x[3] < y[3]
  end)
  local dropped = {}
  for j = cap + 1, #mine do dropped[mine[j][3]] = true end
  local out = {}
  for r = 0, #g / SIZE - 1 do
    if not dropped[r] then out[#out + 1] = string.sub(g, r * SIZE + 1, r * SIZE + SIZE) end
  end
  return table.concat(out)
end
local function count(g, key)
  local c = 0
  for r = 0, #g / SIZE - 1 do
    local p = r * SIZE
    if string.sub(g, p + 1, p + 4) == key and string.byte(g, p + 13) < 128 then c = c + 1 end
  end
  return c
end
-- The id stored at the end of entry e<seq> of slice s (this call's, or Redis's); nil when there is none.
local written_ids = {}
local function entry_id(s, seq_bytes)
  local id = written_ids[s .. ':' .. seq_bytes]
  if id ~= nil then return id end
  local v = redis.call('HGET', big(s), 'e' .. seq_bytes)
  if not v or #v < 2 then return nil end
  local len = struct.unpack('<I2', v, #v - 1)
  return string.sub(v, #v - 1 - len, #v - 2)
end
-- Whether an id (its mixed value m) has a record inside the window in a slice read, whose entry is the id's
-- (another id alike in its 32 bits and group is not it).
local function live(id, m)
  local key = string.sub(m, 5, 8)
  for _, s in ipairs(slices) do
    local b = bits[s]
    if b ~= nil then
      local g = now(s, group_of(m, b))
      for r = 0, #g / SIZE - 1 do
        local p = r * SIZE
        if string.sub(g, p + 1, p + 4) == key and string.byte(g, p + 13) >= 128
            and struct.unpack('<d', g, p + 5) >= hwm - window
            and entry_id(s, struct.pack('>I8', seq_of(r, g))) == id then
          return true
        end
      end
    end
  end
  return false
end
local results, added = {}, {}
for _, e in ipairs(entries) do
  local at, ts, n = e[1], e[2], e[3]
  local id, blob, tails = ARGV[at], ARGV[at + 2], ARGV[at + 4]
  local result = 0
  if not live(id, ARGV[at + 5]) then
    if ts > hwm then hwm = ts end
    if ts >= hwm - window then
      if tails ~= '' and not alone then
        for _, s in ipairs(slices) do
          local b, o, seen = bits[s], orig[s], {}
          for j = 1, n do
            local m = ARGV[at + 5 + j]
            seen[j] = b and tail(o[group_of(m, b)] or '', string.sub(m, 5, 8)) or ABSENT
          end
          local base = seen_at[s]
          local want = base and string.sub(tails, base * n * 8 + 1, (base + 1) * n * 8) or string.rep(ABSENT, n)
          if table.concat(seen) ~= want then result = -1; break end
        end
      end
      if result == 0 then
        seq = seq + 1
        local seq_bytes = struct.pack('>I8', seq)
        local s = math.floor(ts / slice_len)
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
        local rec = struct.pack('<d', ts) .. seq_bytes
        for j = at + 6, at + 5 + n do
          local m = ARGV[j]
          local f, key = group_of(m, b), string.sub(m, 5, 8)
          local g = now(s, f)
          if count(g, key) > 2 * cap then g = trim(g, key) end
          put(s, f, g .. key .. rec)
        end
        local m = ARGV[at + 5]
        local f = group_of(m, b)
        put(s, f, now(s, f) .. string.sub(m, 5, 8) .. struct.pack('<d', ts)
                  .. struct.pack('>I4>I4', math.floor(seq / TWO32) + TAG, seq % TWO32))
        put(s, 'e' .. seq_bytes, blob .. id .. struct.pack('<I2', #id))
        written_ids[s .. ':' .. seq_bytes] = id
        added[s] = (added[s] or 0) + 1
        result = seq
      end
    end
  end
  results[#results + 1] = result
end
for _, s in ipairs(slices) do
  if added[s] then
    local key, c, args = big(s), cur[s], {}
    for _, f in ipairs(order[s]) do
      args[#args + 1] = f
      args[#args + 1] = c[f]
    end
    for a = 1, #args, 2 * PER_CALL do
      redis.call('HSET', key, unpack(args, a, math.min(a + 2 * PER_CALL - 1, #args)))
    end
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
  local gone = math.floor((clock - window) / slice_len) - 1
  redis.call('UNLINK', big(gone))
  redis.call('HDEL', meta, 'k:' .. string.format('%d', gone))
end
if seq > start or hwm > stored_hwm then redis.call('PEXPIRE', meta, ttl) end
return {seq, hwm_s, results}
