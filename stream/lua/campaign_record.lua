-- Counts one batch's duplicates in the campaign view, atomically (stream/campaigns.py, RedisCampaigns.record).
-- KEYS[1]: the size zset. ARGV: the key prefix of the view ({p:ns}:c:), window (s), minutes kept (both growth
-- windows), TTL (ms), samples kept, clusters out of the window dropped at most, then (representative, copies,
-- text, JSON list of the batch's latest copies) per cluster of the batch.
if redis.replicate_commands then redis.replicate_commands() end  -- TIME before writes (Redis < 7)
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local minute = math.floor(now / 60)
local size_key, pre = KEYS[1], ARGV[1]
local window, keep, ttl, nsamples = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local stale_per_batch = tonumber(ARGV[6])
local last_key, first_key, text_key, samples_key = pre .. 'last', pre .. 'first', pre .. 'text', pre .. 'samples'
local minute_key = pre .. 'm:' .. string.format('%d', minute)
local stale = redis.call('ZRANGEBYSCORE', last_key, '-inf', '(' .. (now - window), 'LIMIT', 0, stale_per_batch)
for _, id in ipairs(stale) do
  redis.call('ZREM', size_key, id)
  redis.call('ZREM', last_key, id)
  redis.call('HDEL', first_key, id)
  redis.call('HDEL', text_key, id)
  redis.call('HDEL', samples_key, id)
end
local stamp = string.format('%.3f', now)
for i = 7, #ARGV, 4 do
  local id, n, text, fresh = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], cjson.decode(ARGV[i + 3])
  redis.call('ZINCRBY', size_key, n, id)
  redis.call('ZADD', last_key, now, id)
  redis.call('HSETNX', first_key, id, stamp)
  redis.call('HSETNX', text_key, id, text)
  redis.call('ZINCRBY', minute_key, n, id)
  local old = redis.call('HGET', samples_key, id)
  local samples = old and cjson.decode(old) or {}
  for _, s in ipairs(fresh) do samples[#samples + 1] = s end
  local from = math.max(1, #samples - nsamples + 1)
  local kept = {}
  for j = from, #samples do kept[#kept + 1] = samples[j] end
  redis.call('HSET', samples_key, id, cjson.encode(kept))
end
for _, k in ipairs({size_key, last_key, first_key, text_key, samples_key}) do redis.call('PEXPIRE', k, ttl) end
-- A minute is read while it is in one of the two growth windows: then it can go.
redis.call('PEXPIRE', minute_key, math.min(ttl, (keep + 1) * 60000))
return #stale
