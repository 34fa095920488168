-- Claims' records in one shard of a spread namespace, for every entry of the call (trim.lua comes before
-- this). KEYS[1]: the shard's meta hash; KEYS[2..]: its slice hashes, slices lo, lo + 1, ... (every key
-- the script may touch is declared: a slot being migrated is redirected, never half-read).
-- ARGV: window, slice length, bucket cap, TTL (ms), the caller's high-water mark, lo, the shard's seq
--       when the caller's lookup read it (before the fields; '' if none), then per entry: id, event time,
--       its stamp (the writer's clock in ms * 1024 + the entry's place in its batch), 1 to compare or 0
--       (nothing to compare with: changed), the number n of its bucket fields here, and their names.
-- Appends each entry's record to its fields, with seq max(seq + 1, stamp): increasing per shard, and in
-- one worker's order across shards. A field whose newest record (its last 8 bytes) has a seq above the
-- lookup's changed since the lookup read it. Returns {high-water mark, per entry: 1 (written, none of
-- its fields changed), -1 (written, one changed, or a slice to compare was not declared), 0 (outside the
-- window: nothing written)}.
local meta = KEYS[1]
local window, slice_len, cap, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local hwm, lo, mark = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local hi = lo + #KEYS - 2
local PER_CALL = FIELDS_PER_CALL
local FIRST = 8
local state = redis.call('HMGET', meta, 'seq', 'hwm')
local seq = tonumber(state[1] or '0')
local stored_hwm = tonumber(state[2] or '-inf')
if stored_hwm > hwm then hwm = stored_hwm end
local entries = {}
local low, top = math.huge, hwm
local i = FIRST
while i <= #ARGV do
  local ts, n = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 4])
  entries[#entries + 1] = {i, ts, n}
  if ts < low then low = ts end
  if ts > top then top = ts end
  i = i + 5 + n
end
if hwm > low then low = hwm end
-- The slices a record that can still match may be in; one not declared cannot be compared.
local first, last = math.floor((low - window) / slice_len), math.floor(top / slice_len)
local complete = first >= lo and last <= hi
if first < lo then first = lo end
if last > hi then last = hi end
local function key_of(s) return KEYS[2 + s - lo] end
-- Every field of the call, in every slice compared (the values at the start: the call's own records
-- never count as a change).
local names, named = {}, {}
for _, e in ipairs(entries) do
  for j = e[1] + 5, e[1] + 4 + e[3] do
    local f = ARGV[j]
    if not named[f] then named[f] = true; names[#names + 1] = f end
  end
end
local orig, cur, dirty = {}, {}, {}
local function read(s)
  local o = {}
  for a = 1, #names, PER_CALL do
    local part = {unpack(names, a, math.min(a + PER_CALL - 1, #names))}
    local values = redis.call('HMGET', key_of(s), unpack(part))
    for j = 1, #part do o[part[j]] = values[j] end
  end
  orig[s], cur[s], dirty[s] = o, {}, {}
end
for s = first, last do read(s) end
local results = {}
for _, e in ipairs(entries) do
  local at, ts, n = e[1], e[2], e[3]
  local id, stamp, check = ARGV[at], tonumber(ARGV[at + 2]), ARGV[at + 3] == '1'
  if ts > hwm then hwm = ts end
  local result = 0
  if ts >= hwm - window then
    result = 1
    if not check or not mark or not complete then
      result = -1
    else
      for s = first, last do
        local o = orig[s]
        for j = at + 5, at + 4 + n do
          local v = o[ARGV[j]]
          if v and struct.unpack('>I8', v, #v - 7) > mark then result = -1; break end
        end
        if result == -1 then break end
      end
    end
    seq = math.max(seq + 1, stamp)
    local rec = struct.pack('<dI4', ts, #id) .. id .. struct.pack('>I8', seq)
    local s = math.floor(ts / slice_len)
    if not cur[s] then read(s) end  -- a slice outside the compared ones (an entry far behind the others)
    local c, d = cur[s], dirty[s]
    for j = at + 5, at + 4 + n do
      local f = ARGV[j]
      local v = c[f]
      if v == nil then v = orig[s][f] end
      if v then
        if #v > 2 * cap * #rec then v = trim(v, cap) end
        v = v .. rec
      else
        v = rec
      end
      c[f] = v
      d[f] = true
    end
  end
  results[#results + 1] = result
end
for s, d in pairs(dirty) do
  local args = {}
  for f in pairs(d) do args[#args + 1] = f; args[#args + 1] = cur[s][f] end
  if #args > 0 then
    for a = 1, #args, 2 * PER_CALL do
      redis.call('HSET', key_of(s), unpack(args, a, math.min(a + 2 * PER_CALL - 1, #args)))
    end
    redis.call('PEXPIRE', key_of(s), ttl)
  end
end
local hwm_s = string.format('%.17g', hwm)
redis.call('HSET', meta, 'seq', string.format('%d', seq), 'hwm', hwm_s)
redis.call('PEXPIRE', meta, ttl)
return {hwm_s, results}
