-- A worker's event-time mark, and the group's, in one round trip (stream/align.py, RedisMarks).
-- KEYS[1]: the group's marks hash, field = worker id, value = "<low mark>|<expires at, ms>|<claims>".
-- ARGV: worker id, its low mark (the event time of the next record it will decide; '' when it holds
--       nothing back: idle, or no partitions), the mark's time to live in ms, the partitions it owns
--       ("topic/partition" joined by spaces; '' for none). Low mark and partitions both empty: it leaves.
-- Returns {the others' low mark ('' for none), every live worker's claims}: the lowest low mark of the
-- other workers (a worker orders its own partitions exactly: only the others hold it back), and the
-- partitions each live worker says it owns (the caller checks that they cover the input once: until
-- then somebody's mark is missing or stale). Expired marks (a worker that died) are removed. Server
-- time, so workers' clocks never matter.
-- KEYS[2]: a counter of these calls (their order), returned third.
-- ARGV[5]: '1' when the worker has a mark here it expects to find (it published one and did not leave).
-- If that mark is gone (Redis lost its data, the group's marks were reset after the index lost its data,
-- or the mark expired), the worker may have decided records the index no longer holds: its mark is then
-- written as 0, holding the group back until it has checked the index and written back what it decided
-- (and published again); returned fourth, 1 when so. Also a worker that owns nothing any more: the batches it
-- committed as its partitions went may be what the rebuild missed.
-- When what the others see of the group changes (this worker's low mark or claims, its leaving, a mark
-- expired), the marks as they are now go out on the channel KEYS[1] .. ':moved', headed by the call's
-- number ("<n>\n<worker>|<low mark>|<claims>\n..."): a worker held back by the group waits for that
-- instead of reading the marks again and again, and takes it as a read if it is newer than its own last call.
local key, me, low, ttl, claims = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local n = redis.call('INCR', KEYS[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local before = redis.call('HGET', key, me)
local moved = false
local rejoined = 0
if not before and ARGV[5] == '1' then
  low = '0'
  rejoined = 1
end
if low == '' and claims == '' then
  moved = redis.call('HDEL', key, me) == 1
else
  redis.call('HSET', key, me, low .. '|' .. string.format('%d', now + ttl) .. '|' .. claims)
  if before then
    local l, _, c = string.match(before, '^([^|]*)|(%d+)|(.*)$')
    moved = l ~= low or c ~= claims
  else
    moved = true
  end
end
local all = redis.call('HGETALL', key)
local group_low, low_s, owned, marks = math.huge, '', {}, {tostring(n)}
for i = 1, #all, 2 do
  local l, e, c = string.match(all[i + 1], '^([^|]*)|(%d+)|(.*)$')
  if e == nil or tonumber(e) < now then
    redis.call('HDEL', key, all[i])
    moved = true
  else
    if all[i] ~= me and l ~= '' and tonumber(l) < group_low then group_low = tonumber(l); low_s = l end
    owned[#owned + 1] = c
    marks[#marks + 1] = all[i] .. '|' .. l .. '|' .. c
  end
end
-- The hash goes when no worker has written it for ten lifetimes of a mark.
redis.call('PEXPIRE', key, 10 * ttl)
redis.call('PEXPIRE', KEYS[2], 10 * ttl)
-- pcall: a user not granted the channel (an ACL without it) still shares its marks; the others poll them.
if moved then redis.pcall('PUBLISH', key .. ':moved', table.concat(marks, '\n')) end
return {low_s, owned, n, rejoined}
