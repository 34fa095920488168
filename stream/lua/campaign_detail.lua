-- Read-only (stream/campaigns.py, RedisCampaigns.detail; campaign_entry.lua in front). KEYS[1]: the size zset.
-- ARGV: the view's key prefix, window (s), minutes kept, the id. Returns now, then (when the cluster is in the
-- window) its `entry` and its samples as JSON.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local size_key, pre, id = KEYS[1], ARGV[1], ARGV[4]
local out = {string.format('%.6f', now)}
local last = redis.call('ZSCORE', pre .. 'last', id)
if last and tonumber(last) > now - tonumber(ARGV[2]) then
  local e = entry(pre, size_key, id, math.floor(now / 60), tonumber(ARGV[3]))
  if e then
    out[2] = e
    out[3] = redis.call('HGET', pre .. 'samples', id) or '[]'
  end
end
return out
