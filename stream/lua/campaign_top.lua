-- Read-only (stream/campaigns.py, RedisCampaigns.top; campaign_entry.lua in front). KEYS[1]: the size zset.
-- ARGV: the view's key prefix, window (s), sort, limit, minutes kept, growth candidates. Returns now, the
-- clusters in the window, then one `entry` per cluster shown.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local size_key, pre = KEYS[1], ARGV[1]
local last_key = pre .. 'last'
local window = tonumber(ARGV[2])
local cutoff = string.format('(%.6f', now - window)
local sort, limit, keep = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local minute = math.floor(now / 60)
local total = redis.call('ZCOUNT', last_key, cutoff, '+inf')
local ids = {}
if sort == 'size' then
  -- The largest may include clusters out of the window that no write has dropped yet: skip them.
  local start = 0
  while #ids < limit do
    local page = redis.call('ZREVRANGE', size_key, start, start + limit - 1)
    if #page == 0 then break end
    for _, id in ipairs(page) do
      local last = redis.call('ZSCORE', last_key, id)
      if last and tonumber(last) > now - window and #ids < limit then ids[#ids + 1] = id end
    end
    start = start + limit
  end
elseif sort == 'last' then
  ids = redis.call('ZREVRANGEBYSCORE', last_key, '+inf', cutoff, 'LIMIT', 0, limit)
else
  local since = math.max(now - window, (minute - keep + 1) * 60)
  ids = redis.call('ZREVRANGEBYSCORE', last_key, '+inf', since, 'LIMIT', 0, tonumber(ARGV[6]))
end
local out = {string.format('%.6f', now), total}
for _, id in ipairs(ids) do
  local e = entry(pre, size_key, id, minute, keep)
  if e then out[#out + 1] = e end
end
return out
