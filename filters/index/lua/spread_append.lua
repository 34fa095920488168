-- Claims' records in one shard of a spread namespace when nothing was written there since the lookup: the
-- values the records make, computed by the caller from what its lookup read, written if every slice the
-- lookup read still has the mark it read (spread_claim.lua moves a slice's mark `w` whenever it writes
-- records there, and so does this; a slice dropped and made again takes a higher mark). Else nothing is
-- written and the caller sends the claims to spread_claim.lua, which compares field by field.
-- KEYS: the shard's slice hashes lo, lo + 1, ... (those read and those written, all declared).
-- ARGV: TTL (ms), lo, the number k of slices the lookup read, those k slice numbers, the k marks it read,
--       the layout of the rest: per slice written to, its number (>i4) and its number of fields (>I4);
--       then per slice written to, per field: its name and its value.
-- Returns 1 (written) or 0 (a mark moved: nothing written).
local ttl, lo, k = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local PER_CALL = FIELDS_PER_CALL
local marks = {}  -- slice -> its mark
for c = 1, k do
  local s = tonumber(ARGV[3 + c])
  local m = tonumber(redis.call('HGET', KEYS[1 + s - lo], 'w') or '0')
  if m ~= tonumber(ARGV[3 + k + c]) then return 0 end
  marks[s] = m
end
local layout = ARGV[4 + 2 * k]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local i, at = 5 + 2 * k, 1
while at <= #layout do
  local s, n
  s, n, at = struct.unpack('>i4>I4', layout, at)
  local key = KEYS[1 + s - lo]
  local m = marks[s]
  if not m then m = tonumber(redis.call('HGET', key, 'w') or '0') end
  m = m + 1
  if now > m then m = now end
  local stop = i + 2 * n - 1
  redis.call('HSET', key, 'w', string.format('%.0f', m), unpack(ARGV, i, math.min(i + 2 * PER_CALL - 1, stop)))
  for a = i + 2 * PER_CALL, stop, 2 * PER_CALL do
    redis.call('HSET', key, unpack(ARGV, a, math.min(a + 2 * PER_CALL - 1, stop)))
  end
  redis.call('PEXPIRE', key, ttl)
  i = stop + 1
end
return 1
