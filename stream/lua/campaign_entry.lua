-- Shared by the campaign view's read scripts (loaded in front of campaign_top.lua and campaign_detail.lua):
-- one cluster as id, first, last, text, size, then its copies per minute over the `keep` minutes up to
-- `minute`, oldest first.
local function entry(pre, size_key, id, minute, keep)
  local first = redis.call('HGET', pre .. 'first', id)
  local last = redis.call('ZSCORE', pre .. 'last', id)
  if not first or not last then return nil end
  local counts = {}
  for m = minute - keep + 1, minute do
    counts[#counts + 1] = redis.call('ZSCORE', pre .. 'm:' .. string.format('%d', m), id) or '0'
  end
  return {id, first, last, redis.call('HGET', pre .. 'text', id) or '', redis.call('ZSCORE', size_key, id) or '0',
          counts}
end
