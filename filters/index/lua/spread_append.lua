-- Claims' records in one shard of a spread namespace when nothing was written there since the lookup: the gate
-- of a MULTI/EXEC transaction that writes the values the records make, computed by the caller from what its
-- lookup read, as plain HSETs (moving them in and out of the Lua VM cost more than the writes: an argument
-- costs a string in the VM, hashed byte by byte, and another on its way back to Redis). The transaction, per
-- slice written to: RENAME it to its holding key and SET a string in its place (blocked: an HSET there fails,
-- WRONGTYPE); then this script; the HSETs; then per slice written to GETDEL (deletes it if it is a string,
-- still blocked) and RENAMENX of its holding key back (if this script did not). So the writes happen only if
-- this script ran and found every mark the lookup read (a script missing from the node's cache writes
-- nothing), nobody sees a slice blocked (one transaction), and a transaction Redis refuses when queued (a key
-- moved, a slot being migrated: a holding key never exists; out of memory) runs nothing.
-- KEYS: the shard's slice hashes lo, lo + 1, ..., hi (those read and those written, all declared), then as
-- many holding keys, in the same order.
-- ARGV: TTL (ms), lo, the number k of slices the lookup read, those k slice numbers, the k marks it read, the
--       number t of slices written to, those t slice numbers.
-- If every slice the lookup read still has the mark it read (a slice written to: in its holding key), each
-- slice written to is put back in place, its mark `w` moved (to the higher of its value + 1 and this node's
-- clock in µs: a slice dropped and made again does not take an old mark again; spread_claim.lua moves it
-- likewise) and its TTL renewed: 1. Else nothing: 0 (the caller sends the claims to spread_claim.lua, which
-- compares field by field).
local n = #KEYS / 2
local ttl, lo, k = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local t = tonumber(ARGV[4 + 2 * k])
local held = {}  -- slice -> its place in KEYS, if written to (held aside)
for c = 1, t do
  local s = tonumber(ARGV[4 + 2 * k + c])
  held[s] = 1 + s - lo
end
local marks = {}
for c = 1, k do
  local s = tonumber(ARGV[3 + c])
  local at = held[s]
  local m = tonumber(redis.call('HGET', at and KEYS[at + n] or KEYS[1 + s - lo], 'w') or '0')
  if m ~= tonumber(ARGV[3 + k + c]) then return 0 end
  marks[s] = m
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
for s, at in pairs(held) do
  local key = KEYS[at]
  redis.call('DEL', key)
  if redis.call('EXISTS', KEYS[at + n]) == 1 then redis.call('RENAME', KEYS[at + n], key) end
  local m = (marks[s] or tonumber(redis.call('HGET', key, 'w') or '0')) + 1
  if now > m then m = now end
  redis.call('HSET', key, 'w', string.format('%.0f', m))
  redis.call('PEXPIRE', key, ttl)
end
return 1
