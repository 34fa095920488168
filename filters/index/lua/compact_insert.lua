-- One caller's insert round in the compact layout, atomically (trim16.lua, insert_slices.lua and round_start.lua
-- come before this): insert.lua's checks and writes, the fields where the layout keeps them (docs/design.md, "The compact
-- slot layout").
-- KEYS[1]: the namespace's meta hash.
-- ARGV: slice key prefix, window, slice length, bucket cap, TTL (ms), the caller's high-water mark of
--       event time, the slices the caller read (comma-separated, in the order of its tails), the seq at its
--       lookup and how many it inserted since, the window's clock ('' for the high-water mark), the marker
--       the caller's lookup read ('' for no check), a token that names the namespace if this call makes it
--       (`gen`: a namespace lost and made again gets another), the entries a slice is expected to hold (the
--       `rate` option's: a slice made here gets small hashes for at least that many; 0 for none), then per
--       entry: id, event time, encoded entry, the
--       number n of its buckets, what the caller saw of them (per slice it read, the last 8 bytes of each
--       bucket field, zeros if absent; '' for no check), the 32-bit mixed hashes of its n bucket keys and
--       of its id (4 bytes big-endian each: a field's small hash is the top k bits), and its n bucket field
--       names.
-- Returns {seq, high-water mark, per entry: its seq (inserted), 0 (its id is live, or it is outside the
--          window) or -1 (a bucket changed since the caller saw it: not inserted)}, {-1, '', {}} when the
--          marker is not the caller's, {-2, '', {}} when the namespace is of another layout: nothing written.
local MARK, LISTPACK = '\0', 64
local K_FIRST, K_MIN, K_MAX, PER_ENTRY, FILL, INLINE_BITS = COMPACT_BITS
local hash = {}  -- field -> its 32-bit mixed hash (nil: it lives in the slice hash)
for _, e in ipairs(entries) do
  local at, n = e[1], e[3]
  local hs = ARGV[at + 5]
  for j = 1, n do hash[ARGV[at + 5 + j]] = struct.unpack('>I4', hs, 4 * j - 3) end
  local ifield = 'i' .. ARGV[at]
  if #ifield <= LISTPACK then hash[ifield] = struct.unpack('>I4', hs, 4 * n + 1) end
end
local function key_of(s, f)  -- where field f of slice s lives (nil: its slice has no small hashes yet)
  local h = hash[f]
  if h == nil then return big(s) end
  local b = bits[s]
  if b == nil then return nil end
  return big(s) .. ':' .. string.format('%d', math.floor(h / 2 ^ (32 - b)))
end
-- What each slice holds of the fields this call needs: every id and, to compare with what the caller
-- saw, every bucket field (when alone, only those of the slices written to).
local orig, cur, dirty, marked = {}, {}, {}, {}
for _, s in ipairs(slices) do
  local target_only = {}
  local groups, order, seen = {}, {}, {}
  local function want(f)
    if seen[f] then return end
    seen[f] = true
    local key = key_of(s, f)
    if key == nil then return end
    local g = groups[key]
    if g == nil then g = {}; groups[key] = g; order[#order + 1] = key end
    g[#g + 1] = f
  end
  for _, e in ipairs(entries) do
    local at, n = e[1], e[3]
    want('i' .. ARGV[at])
    if not alone or s == math.floor(e[2] / slice_len) then
      for j = at + 6, at + 5 + n do want(ARGV[j]) end
    end
  end
  local o, again = {}, {}
  for _, key in ipairs(order) do
    local names = groups[key]
    for a = 1, #names, PER_CALL do
      local part = {unpack(names, a, math.min(a + PER_CALL - 1, #names))}
      local values = redis.call('HMGET', key, unpack(part))
      for j = 1, #part do
        o[part[j]] = values[j]
        if values[j] == MARK and hash[part[j]] ~= nil and string.sub(part[j], 1, 1) == 'b' then
          again[#again + 1] = part[j]
        end
      end
    end
  end
  local m = {}
  for a = 1, #again, PER_CALL do  -- buckets kept in the slice hash behind their mark
    local part = {unpack(again, a, math.min(a + PER_CALL - 1, #again))}
    local values = redis.call('HMGET', big(s), unpack(part))
    for j = 1, #part do o[part[j]] = values[j]; m[part[j]] = true end
  end
  orig[s], cur[s], dirty[s], marked[s] = o, {}, {}, m
end
local function now(s, f)
  local v = cur[s][f]
  if v == nil then v = orig[s][f] end
  return v
end
local results, added = {}, {}
for _, e in ipairs(entries) do
  local at, ts, n = e[1], e[2], e[3]
  local id, blob, tails = ARGV[at], ARGV[at + 2], ARGV[at + 4]
  local ifield = 'i' .. id
  local result = 0
  local live = false
  for _, s in ipairs(slices) do
    local old = now(s, ifield)
    if old and struct.unpack('<d', old) >= hwm - window then live = true; break end
  end
  if not live then
    if ts > hwm then hwm = ts end
    if ts >= hwm - window then
      if tails ~= '' and not alone and buckets_moved(tails, n, slices, seen_at, function(s, j)
        local v = orig[s][ARGV[at + 5 + j]]
        return v and string.sub(v, -8) or ABSENT
      end) then result = -1 end
      if result == 0 then
        seq = seq + 1
        local seq_bytes = struct.pack('>I8', seq)
        local rec = struct.pack('<d', ts) .. seq_bytes
        local s = math.floor(ts / slice_len)
        if bits[s] == nil then  -- the slice's first write: small hashes for the rate of the slice before
          local prev = tonumber(redis.call('HGET', big(s - 1), 'n') or '')
          local b = K_FIRST
          if prev or expected > 0 then  -- (or the rate expected, if more)
            local want_hashes = math.ceil(math.max(prev or 0, expected) * PER_ENTRY / FILL)
            b = 0
            while 2 ^ b < want_hashes do b = b + 1 end
            b = math.min(K_MAX, math.max(K_MIN, b))
          end
          bits[s] = b
          redis.call('HSET', meta, 'k:' .. string.format('%d', s), b)
        end
        local c, d, once = cur[s], dirty[s], {}
        for j = at + 6, at + 5 + n do
          local f = ARGV[j]
          local v = now(s, f)
          if once[f] then  -- a key given twice counts once
          elseif v then
            if #v > 2 * cap * 16 then v = trim16(v, cap) end
            v = v .. rec
          else
            v = rec
          end
          once[f] = true
          c[f] = v
          d[f] = true
        end
        c[ifield] = rec
        d[ifield] = true
        local efield = 'e' .. seq_bytes
        c[efield] = blob .. id .. struct.pack('<I2', #id)
        d[efield] = true
        added[s] = (added[s] or 0) + 1
        result = seq
      end
    end
  end
  results[#results + 1] = result
end
for _, s in ipairs(slices) do
  local groups, order = {}, {}
  local function put(key, f, v)
    local g = groups[key]
    if g == nil then g = {}; groups[key] = g; order[#order + 1] = key end
    g[#g + 1] = f
    g[#g + 1] = v
  end
  for f in pairs(dirty[s]) do
    local v = cur[s][f]
    local key = key_of(s, f)
    if marked[s][f] then
      key = big(s)
    elseif key ~= big(s) and #v > LISTPACK then
      put(key, f, MARK)
      key = big(s)
    end
    put(key, f, v)
  end
  for _, key in ipairs(order) do
    local args = groups[key]
    hset_pairs(key, args)
    redis.call('PEXPIRE', key, ttl)
  end
  if added[s] then
    redis.call('HINCRBY', big(s), 'n', added[s])
    redis.call('PEXPIRE', big(s), ttl)
  end
end
local hwm_s = string.format('%.17g', hwm)
if seq > start then
  redis.call('HSET', meta, 'seq', string.format('%d', seq), 'layout', 'compact')
  redis.call('HSETNX', meta, 'gen', ARGV[12])
  local clock = hwm
  if ARGV[10] ~= '' then clock = tonumber(ARGV[10]) end
  local gone = math.floor((clock - window) / slice_len) - 1
  redis.call('UNLINK', big(gone))
  -- Its small hashes: here when they are few; else (2^k keys: too many for one script call) by the clients'
  -- next rounds, which find its bits `k:<n>` still in the meta hash (redis_compact.py, `_reap_commands`).
  local gone_bits = tonumber(redis.call('HGET', meta, 'k:' .. string.format('%d', gone)) or '')
  if gone_bits and gone_bits <= INLINE_BITS then
    local keys = {}
    for j = 0, 2 ^ gone_bits - 1 do
      keys[#keys + 1] = big(gone) .. ':' .. string.format('%d', j)
      if #keys == 1024 then redis.call('UNLINK', unpack(keys)); keys = {} end
    end
    if #keys > 0 then redis.call('UNLINK', unpack(keys)) end
    redis.call('HDEL', meta, 'k:' .. string.format('%d', gone))
  end
end
if hwm > stored_hwm then redis.call('HSET', meta, 'hwm', hwm_s) end
if seq > start or hwm > stored_hwm then redis.call('PEXPIRE', meta, ttl) end
return {seq, hwm_s, results}
