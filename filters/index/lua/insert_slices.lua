-- Shared by the insert scripts of the slot layouts (loaded in front of insert.lua, compact_insert.lua and
-- group_insert.lua). `insert_slices`: an insert round's entries ({place of the entry's first argument, event time, number n of
-- its buckets}), read from ARGV[first] on, each entry `width` + n arguments (`width` only, when `fixed`: its
-- buckets in one argument); the slices a record that can still match may
-- be in (from the lowest horizon of the round to its highest event time, and those of the high-water mark's
-- window); the slices the caller read
-- (ARGV[7], comma-separated) by their place among the caller's; and whether the caller read them all.
local function insert_slices(first, width, hwm, window, slice_len, fixed)
  local entries = {}
  local low, top = math.huge, hwm
  local i = first
  while i <= #ARGV do
    local n = tonumber(ARGV[i + 3])
    local ts = tonumber(ARGV[i + 1])
    entries[#entries + 1] = {i, ts, n}
    if ts < low then low = ts end
    if ts > top then top = ts end
    i = i + width + (fixed and 0 or n)
  end
  if hwm > low then low = hwm end
  local slices = {}
  local first = math.floor((low - window) / slice_len)
  -- A round whose event times all come after the high-water mark (a restore's: no lookup raised the caller's)
  -- finds its first entries' live ids inside the window of that mark: its slices too (records are never newer
  -- than the mark, so the slices in between hold nothing).
  if hwm > -math.huge then
    for s = math.floor((hwm - window) / slice_len), math.min(math.floor(hwm / slice_len), first - 1) do
      slices[#slices + 1] = s
    end
  end
  for s = first, math.floor(top / slice_len) do slices[#slices + 1] = s end
  local seen_at = {}
  local k = 0
  for s in string.gmatch(ARGV[7], '[^,]+') do seen_at[tonumber(s)] = k; k = k + 1 end
  local read_all = true
  for _, s in ipairs(slices) do
    if not seen_at[s] then read_all = false end
  end
  return entries, slices, seen_at, read_all
end
local ABSENT = string.rep('\0', 8)  -- a bucket that held nothing, as its tail (8 bytes)
-- Whether an entry's buckets changed since the caller read them (then the entry is not inserted, -1): in each
-- slice, the tail of each of its n buckets as the slice holds it now (`tail(s, j)`: bucket j's last 8 bytes,
-- ABSENT if it holds nothing) against what the caller saw (`tails`: n tails per slice it read, in the order of
-- ARGV[7]; a slice it did not read, it saw empty).
local function buckets_moved(tails, n, slices, seen_at, tail)
  for _, s in ipairs(slices) do
    local seen = {}
    for j = 1, n do seen[j] = tail(s, j) end
    local base = seen_at[s]
    local want = base and string.sub(tails, base * n * 8 + 1, (base + 1) * n * 8) or string.rep(ABSENT, n)
    if table.concat(seen) ~= want then return true end
  end
  return false
end
-- Sets the field-value pairs `args` ({field, value, ...}) in hash `key`, FIELDS_PER_CALL pairs a call.
local function hset_pairs(key, args)
  for a = 1, #args, 2 * FIELDS_PER_CALL do
    redis.call('HSET', key, unpack(args, a, math.min(a + 2 * FIELDS_PER_CALL - 1, #args)))
  end
end
