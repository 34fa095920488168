-- Shared by the insert scripts of the compact and group layouts (loaded after insert_slices.lua, in front of
-- compact_insert.lua and group_insert.lua, whose headers say what KEYS and ARGV hold): a round's start. Its
-- arguments; the namespace's state, the round refused with nothing written ({-1, '', {}}: the marker is not the
-- caller's; {-2, '', {}}: the namespace is of another layout); the round's entries and slices (`insert_slices`);
-- and the bits of each slice. The layout's name and whether an entry's buckets are one argument are filled in
-- where the script is made (`_script` of redis_compact.py and redis_group.py).
local meta, spre = KEYS[1], ARGV[1]
local window, slice_len, cap, ttl = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local hwm = tonumber(ARGV[6])
local FIRST, PER_CALL = 14, FIELDS_PER_CALL
local expected = tonumber(ARGV[13])
local state = redis.call('HMGET', meta, 'seq', 'hwm', 'epoch', 'layout')
if ARGV[11] ~= '' and state[3] ~= ARGV[11] then return {-1, '', {}} end
if state[1] and state[4] ~= ROUND_LAYOUT then return {-2, '', {}} end
local stored_hwm = tonumber(state[2] or '-inf')
if stored_hwm > hwm then hwm = stored_hwm end
local start = tonumber(state[1] or '0')
local seq = start
local alone = start == tonumber(ARGV[8]) + tonumber(ARGV[9])
local entries, slices, seen_at, read_all = insert_slices(FIRST, 6, hwm, window, slice_len, ROUND_FIXED)
if not read_all then alone = false end
-- The bits of each slice (nil: nothing written there yet).
local bits = {}
do
  local names = {}
  for j, s in ipairs(slices) do names[j] = 'k:' .. string.format('%d', s) end
  local ks = redis.call('HMGET', meta, unpack(names))
  for j, s in ipairs(slices) do bits[s] = tonumber(ks[j]) end
end
local function big(s) return spre .. string.format('%d', s) end
