-- Claims' records in one shard of a spread namespace, for the bucket fields that are not new (trim.lua comes
-- before this; a field its claimant's lookup saw in no slice is created by HSETNX instead, with no script).
-- KEYS: the shard's slice hashes lo, lo + 1, ... (every key the script may touch is declared: a slot being
-- migrated is redirected, never half-read).
-- ARGV: bucket cap, TTL (ms), lo, the number k of slices the lookup read, those k slice numbers, then
--       sections, one per slice written to: its slice number, its number of entries, then per entry: its
--       record (<ts: f64 LE><id length: u32 LE><id><seq: u64 BE>, the seq being the writer's stamp: its
--       clock in ms * 1024 + the entry's place in its batch), 1 to compare or 0 (nothing to compare
--       with: changed), the number n of its fields here, and per field: its name and, when compared, what
--       the lookup saw of it in each of the k slices: its length (0 if absent) and the seq of its last
--       record (0 if absent).
-- Appends each entry's record to its fields. Returns per entry 1 (written, none of its fields changed since
-- the lookup read them) or -1 (written; one did, or nothing to compare with). A field changed if its
-- length or its last record's seq is not what the lookup saw: a record appended makes it longer, unless a
-- trim came with it, and a record whose seq is its field's last one gets the next. The comparison is with
-- the values at the start of the call: the call's own records never count. No string is made but the
-- values written (the Lua VM interns every string: that is most of a script's cost).
local cap, ttl, lo, k = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local PER_CALL = FIELDS_PER_CALL
local compared = {}
for c = 1, k do compared[c] = tonumber(ARGV[4 + c]) end
local FIRST = 5 + k
local names, named = {}, {}
local i = FIRST
while i <= #ARGV do  -- every field of the call, once
  local count = tonumber(ARGV[i + 1])
  i = i + 2
  for _ = 1, count do
    local check, n = ARGV[i + 1] == '1', tonumber(ARGV[i + 2])
    local step = check and 1 + 2 * k or 1
    for f = i + 3, i + 2 + n * step, step do
      local name = ARGV[f]
      if not named[name] then named[name] = true; names[#names + 1] = name end
    end
    i = i + 3 + n * step
  end
end
local orig = {}  -- slice -> field -> value at the start of the call
local function values(s)
  local o = orig[s]
  if not o then
    o = {}
    for a = 1, #names, PER_CALL do
      local part = {unpack(names, a, math.min(a + PER_CALL - 1, #names))}
      local vs = redis.call('HMGET', KEYS[1 + s - lo], unpack(part))
      for b = 1, #part do o[part[b]] = vs[b] end
    end
    orig[s] = o
  end
  return o
end
local function last(v)  -- the seq of a value's last record
  return struct.unpack('>I8', v, #v - 7)
end
local results = {}
local written = {}  -- slice -> field -> its value now
i = FIRST
while i <= #ARGV do
  local target, count = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  i = i + 2
  local base = values(target)
  local cur = written[target]
  if not cur then cur = {}; written[target] = cur end
  for _ = 1, count do
    local rec, check, n = ARGV[i], ARGV[i + 1] == '1', tonumber(ARGV[i + 2])
    local step = check and 1 + 2 * k or 1
    local result = check and 1 or -1
    for f = i + 3, i + 2 + n * step, step do
      local name = ARGV[f]
      if result == 1 then
        for c = 1, k do
          local v = values(compared[c])[name]
          local length = v and #v or 0
          if length ~= tonumber(ARGV[f + 2 * c - 1]) or length > 0 and last(v) ~= tonumber(ARGV[f + 2 * c]) then
            result = -1
            break
          end
        end
      end
      local v = cur[name]
      if v == nil then v = base[name] end
      if v then
        local r = rec
        local seq = last(rec)
        if last(v) >= seq then r = string.sub(rec, 1, -9) .. struct.pack('>I8', last(v) + 1) end
        if #v > 2 * cap * #r then v = trim(v, cap) end
        v = v .. r
      else
        v = rec
      end
      cur[name] = v
    end
    results[#results + 1] = result
    i = i + 3 + n * step
  end
end
for s, cur in pairs(written) do
  local args = {}
  for name, v in pairs(cur) do args[#args + 1] = name; args[#args + 1] = v end
  for a = 1, #args, 2 * PER_CALL do
    redis.call('HSET', KEYS[1 + s - lo], unpack(args, a, math.min(a + 2 * PER_CALL - 1, #args)))
  end
  if #args > 0 then redis.call('PEXPIRE', KEYS[1 + s - lo], ttl) end
end
return results
