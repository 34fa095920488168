-- One caller's insert round, atomically (trim.lua and insert_slices.lua come before this).
-- KEYS[1]: the namespace's meta hash.
-- ARGV: slice key prefix, window, slice length, bucket cap, TTL (ms), the caller's high-water mark of
--       event time, the slices the caller read (comma-separated, in the order of its tails), the seq
--       at its lookup and how many it inserted since, the window's clock ('' for the high-water mark:
--       nobody looks for anything older than it less the window), the marker the caller's lookup read ('' for
--       no check: see the Fence of filters/index/redis.py), then per entry: id, event time, encoded entry,
--       the number n of its buckets, what the caller saw of them (per slice it read, the last 8 bytes
--       of each bucket field, zeros if absent; '' for no check), and its n bucket field names.
-- Returns {seq, high-water mark, per entry: its seq (inserted), 0 (its id is live, or it is outside
--          the window: nothing to do) or -1 (a bucket changed since the caller saw it: not inserted)},
--         or {-1, '', {}} when the marker is not the caller's (the index was lost or rebuilt): nothing written.
local meta, spre = KEYS[1], ARGV[1]
local window, slice_len, cap, ttl = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local hwm = tonumber(ARGV[6])
local FIRST, PER_CALL = 12, FIELDS_PER_CALL
local state = redis.call('HMGET', meta, 'seq', 'hwm', 'epoch')
if ARGV[11] ~= '' and state[3] ~= ARGV[11] then return {-1, '', {}} end
local stored_hwm = tonumber(state[2] or '-inf')
if stored_hwm > hwm then hwm = stored_hwm end
local start = tonumber(state[1] or '0')
local seq = start
-- Nobody else inserted since the caller's lookup (and it read every slice, below): no bucket can
-- differ from what it saw.
local alone = start == tonumber(ARGV[8]) + tonumber(ARGV[9])
local entries, slices, seen_at, read_all = insert_slices(FIRST, 5, hwm, window, slice_len)
if not read_all then alone = false end
-- What each slice holds of the fields this call needs: every id and, to compare with what the caller
-- saw, every bucket field (when alone, only those of the slices written to).
local wanted = {}
for _, s in ipairs(slices) do wanted[s] = {{}, {}} end
for _, e in ipairs(entries) do
  local at, n = e[1], e[3]
  local target = math.floor(e[2] / slice_len)
  for _, s in ipairs(slices) do
    local w = wanted[s]
    local f = 'e' .. ARGV[at]
    if not w[2][f] then w[2][f] = true; w[1][#w[1] + 1] = f end
    if not alone or s == target then
      for j = at + 5, at + 4 + n do
        f = ARGV[j]
        if not w[2][f] then w[2][f] = true; w[1][#w[1] + 1] = f end
      end
    end
  end
end
local orig, cur, dirty = {}, {}, {}
for _, s in ipairs(slices) do
  local o, key, names = {}, spre .. string.format('%d', s), wanted[s][1]
  for a = 1, #names, PER_CALL do
    local part = {unpack(names, a, math.min(a + PER_CALL - 1, #names))}
    local values = redis.call('HMGET', key, unpack(part))
    for j = 1, #part do o[part[j]] = values[j] end
  end
  orig[s], cur[s], dirty[s] = o, {}, {}
end
local function now(s, f)  -- a field as this call left it so far
  local v = cur[s][f]
  if v == nil then v = orig[s][f] end
  return v
end
local results, added = {}, {}
for _, e in ipairs(entries) do
  local at, ts, n = e[1], e[2], e[3]
  local id, blob, tails = ARGV[at], ARGV[at + 2], ARGV[at + 4]
  local efield = 'e' .. id
  local result = 0
  local live = false  -- as in MemoryIndex, a live id keeps its first entry and moves nothing
  for _, s in ipairs(slices) do
    local old = now(s, efield)
    if old and struct.unpack('<d', old, 2) >= hwm - window then live = true; break end
  end
  if not live then
    if ts > hwm then hwm = ts end
    if ts >= hwm - window then  -- else it is outside the window already and could never match
      if tails ~= '' and not alone and buckets_moved(tails, n, slices, seen_at, function(s, j)
        local v = orig[s][ARGV[at + 4 + j]]
        return v and string.sub(v, -8) or ABSENT
      end) then result = -1 end
      if result == 0 then
        seq = seq + 1
        local rec = struct.pack('<dI4', ts, #id) .. id .. struct.pack('>I8', seq)
        local s = math.floor(ts / slice_len)
        local c, d = cur[s], dirty[s]
        for j = at + 5, at + 4 + n do
          local f = ARGV[j]
          local v = now(s, f)
          if v then
            if #v > 2 * cap * #rec then v = trim(v, cap) end
            v = v .. rec
          else
            v = rec
          end
          c[f] = v
          d[f] = true
        end
        c[efield] = blob
        d[efield] = true
        added[s] = (added[s] or 0) + 1
        result = seq
      end
    end
  end
  results[#results + 1] = result
end
for _, s in ipairs(slices) do
  local args = {}
  for f in pairs(dirty[s]) do args[#args + 1] = f; args[#args + 1] = cur[s][f] end
  if #args > 0 then
    local key = spre .. string.format('%d', s)
    hset_pairs(key, args)
    redis.call('HINCRBY', key, 'n', added[s])
    redis.call('PEXPIRE', key, ttl)
  end
end
local hwm_s = string.format('%.17g', hwm)
if seq > start then
  redis.call('HSET', meta, 'seq', string.format('%d', seq))
  -- The slice wholly older than the window of the clock holds nothing that can match any more (aligned
  -- workers' clock is their group's low watermark: a worker behind the newest still finds its window).
  local clock = hwm
  if ARGV[10] ~= '' then clock = tonumber(ARGV[10]) end
  redis.call('UNLINK', spre .. string.format('%d', math.floor((clock - window) / slice_len) - 1))
end
if hwm > stored_hwm then redis.call('HSET', meta, 'hwm', hwm_s) end
if seq > start or hwm > stored_hwm then redis.call('PEXPIRE', meta, ttl) end
return {seq, hwm_s, results}
