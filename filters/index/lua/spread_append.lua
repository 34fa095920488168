-- Claims' records in one shard of a spread namespace when nothing was written there since the lookup: the
-- gate of a MULTI/EXEC transaction [this script, EVAL'd ('gate'); an HSET per slice written to, of the values
-- the records make, computed by the caller from what its lookup read; this script again ('release')]. The
-- values go as plain HSETs: moving them in and out of the Lua VM cost more than the writes (an argument
-- costs a string in the VM, hashed byte by byte, and another on its way back to Redis).
-- KEYS: the shard's slice hashes lo, lo + 1, ..., hi (those read and those written, all declared), then as
-- many keys, each holding its slice while the writes are blocked.
-- ARGV 'gate': 1, TTL (ms), lo, the number k of slices the lookup read, those k slice numbers, the k marks it
--   read, the number t of slices written to, those t slice numbers. If every slice the lookup read still has
--   the mark it read, moves the mark `w` of each slice written to (to the higher of its value + 1 and this
--   node's clock in µs: a slice dropped and made again does not take an old mark again, and spread_claim.lua
--   moves it likewise) and renews its TTL: 1, the HSETs write. Else blocks them: each slice written to moves to
--   its holding key (if it exists) and a string takes its place, so that the HSETs fail (WRONGTYPE): 0, and
--   the caller sends the claims to spread_claim.lua, which compares field by field.
-- ARGV 'release': 2, lo, t, the t slice numbers: a slice that holds a string (blocked) gets back what its
--   holding key holds, or nothing. Returns 1. (Run by EVALSHA after the EVAL of the same script in the same
--   transaction: it cannot be missing from the script cache.)
-- Everything is in one transaction: nobody sees a slice blocked, and a transaction Redis refuses (a key
-- moved, a slot being migrated, out of memory) runs nothing.
local n = #KEYS / 2
if ARGV[1] == '2' then
  local lo, t = tonumber(ARGV[2]), tonumber(ARGV[3])
  for c = 1, t do
    local at = 1 + tonumber(ARGV[3 + c]) - lo
    local key = KEYS[at]
    if redis.call('TYPE', key).ok == 'string' then
      redis.call('DEL', key)
      if redis.call('EXISTS', KEYS[at + n]) == 1 then redis.call('RENAME', KEYS[at + n], key) end
    end
  end
  return 1
end
local ttl, lo, k = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local t = tonumber(ARGV[5 + 2 * k])
local marks = {}
for c = 1, k do
  local s = tonumber(ARGV[4 + c])
  local m = tonumber(redis.call('HGET', KEYS[1 + s - lo], 'w') or '0')
  if m ~= tonumber(ARGV[4 + k + c]) then
    for d = 1, t do
      local at = 1 + tonumber(ARGV[5 + 2 * k + d]) - lo
      if redis.call('EXISTS', KEYS[at]) == 1 then redis.call('RENAME', KEYS[at], KEYS[at + n]) end
      redis.call('SET', KEYS[at], 'blocked')
    end
    return 0
  end
  marks[s] = m
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
for c = 1, t do
  local s = tonumber(ARGV[5 + 2 * k + c])
  local key = KEYS[1 + s - lo]
  local m = (marks[s] or tonumber(redis.call('HGET', key, 'w') or '0')) + 1
  if now > m then m = now end
  redis.call('HSET', key, 'w', string.format('%.0f', m))
  redis.call('PEXPIRE', key, ttl)
end
return 1
