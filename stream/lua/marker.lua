-- The marker of a fenced index, set in one meta hash once a rebuild wrote the window (stream/changelog.py,
-- IndexGuard), only where the rebuild's stamp still is: a meta hash without it lost its data since the guard
-- stamped it (its master restarted empty, or failed over to a replica that had not synced), and must not get
-- a marker that says it holds the window.
-- KEYS[1]: the meta hash. ARGV: the stamp's field, the stamp, the marker's field, the marker, the hash's TTL (ms).
-- Returns 1 when the marker was set (and the stamp removed), 0 when the stamp was not there (nothing written).
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[3], ARGV[4])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
