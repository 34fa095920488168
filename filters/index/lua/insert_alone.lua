-- KEYS[1]: the namespace's meta hash. ARGV: seq and high-water mark expected ('' for none), the new
-- seq and high-water mark (written when different), TTL (ms), a slice key to unlink ('' for none),
-- the marker the caller's lookup read ('' for no check: see the Fence of filters/index/redis.py), what a
-- layout keeps beside them in the meta hash (none in the slot layout: 0, '', ''): the number m of its
-- field-value pairs to set, the pairs, a token set as its `gen` if it has none and a field to delete ('' for
-- none each), then per slice written: its key, the number of entries, the number of field-value pairs, the
-- pairs.
-- Returns 1 (written), 0 (somebody else wrote meanwhile) or -1 (the marker is not the caller's: the
-- index was lost or rebuilt); nothing is written but on 1.
local meta, ttl = KEYS[1], ARGV[5]
local state = redis.call('HMGET', meta, 'seq', 'hwm', 'epoch')
if ARGV[7] ~= '' and state[3] ~= ARGV[7] then return -1 end
if (state[1] or '0') ~= ARGV[1] or (state[2] or '') ~= ARGV[2] then return 0 end
local m = tonumber(ARGV[8])
local gen, drop = ARGV[9 + 2 * m], ARGV[10 + 2 * m]
local i = 11 + 2 * m
while i <= #ARGV do
  local key, entries, pairs = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  i = i + 3
  for a = i, i + 2 * pairs - 1, 2 * FIELDS_PER_CALL do
    redis.call('HSET', key, unpack(ARGV, a, math.min(a + 2 * FIELDS_PER_CALL, i + 2 * pairs) - 1))
  end
  i = i + 2 * pairs
  redis.call('HINCRBY', key, 'n', entries)
  redis.call('PEXPIRE', key, ttl)
end
if m > 0 then redis.call('HSET', meta, unpack(ARGV, 9, 8 + 2 * m)) end
if gen ~= '' then redis.call('HSETNX', meta, 'gen', gen) end
if ARGV[3] ~= ARGV[1] then redis.call('HSET', meta, 'seq', ARGV[3]) end
if ARGV[4] ~= ARGV[2] then redis.call('HSET', meta, 'hwm', ARGV[4]) end
if ARGV[3] ~= ARGV[1] or ARGV[4] ~= ARGV[2] or m > 0 then redis.call('PEXPIRE', meta, ttl) end
if ARGV[6] ~= '' then redis.call('UNLINK', ARGV[6]) end
if drop ~= '' then redis.call('HDEL', meta, drop) end
return 1
