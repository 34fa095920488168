-- Claims' records in one shard of a spread namespace, all the claims of a round in the shard in one call
-- (trim.lua comes before this).
-- KEYS: the shard's slice hashes lo, lo + 1, ... (every key the script may touch is declared: a slot being
-- migrated is redirected, never half-read).
-- ARGV: bucket cap, TTL (ms), lo, the number k of slices the lookup read, those k slice numbers, the k
--       marks it read there (field `w`; 0 if absent, -1 if unknown: compare every field), what it saw of
--       the fields it compares (per field in the order below, per slice read: its length (0 if absent,
--       >I4) and the seq of its last record (zeros if absent, >I8): 12 bytes a slice), the layout of the
--       rest (below), then per entry: its record (<ts: f64 LE><id length: u32 LE><id><seq: u64 BE>, the
--       seq being the writer's stamp: its clock in ms * 1024 + the entry's place in its batch) and its
--       field names: first those the lookup saw in the slice written to (all of them, if not compared),
--       then the others. The layout: sections, one per slice written to: its slice number (>i4) and its
--       number of entries (>I4), then per entry: 1 to compare or 0 (nothing to compare with: changed; B)
--       and the numbers of its fields of each kind (>H each). (One argument each for what the script reads
--       as numbers: an argument costs a string in the Lua VM.)
-- Appends each entry's record to its fields. Returns per entry 1 (written, none of its fields changed since
-- the lookup read them) or -1 (written; one did, or nothing to compare with). Every call that writes
-- records in a slice moves its mark `w` (to the higher of its value + 1 and this node's clock in µs: a
-- slice dropped and made again does not take an old mark again), so a slice whose mark is what the lookup
-- read holds the lookup's values still: its fields are not read to be compared, and a field the lookup
-- did not see in it is not there (it is created, not read). A field of a slice whose mark moved changed if
-- its length or its last record's seq is not what the lookup saw: a record appended makes it longer,
-- unless a trim came with it, and a record whose seq is its field's last one gets the next. The comparison
-- is with the values at the start of the call: the call's own records never count. No string is made but
-- the values written (the Lua VM interns every string: that is most of a script's cost).
local cap, ttl, lo, k = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local PER_CALL = FIELDS_PER_CALL
local seen, layout = ARGV[5 + 2 * k], ARGV[6 + 2 * k]
local FIRST = 7 + 2 * k
local marks = {}  -- slice -> its mark at the start of the call
local function mark(s)
  local m = marks[s]
  if not m then
    m = tonumber(redis.call('HGET', KEYS[1 + s - lo], 'w') or '0')
    marks[s] = m
  end
  return m
end
local compared, moved, place = {}, {}, {}  -- c -> slice; c -> its mark moved; slice -> c
local any = false
for c = 1, k do
  local s = tonumber(ARGV[4 + c])
  compared[c], place[s] = s, c
  moved[c] = mark(s) ~= tonumber(ARGV[4 + k + c])
  any = any or moved[c]
end
-- The fields to read, per slice: in a slice written to, those whose value the call needs (all but the
-- fields of compared entries that the lookup did not see there, if its mark did not move); in a slice
-- whose mark moved, those of compared entries.
local wanted = {}
local function want(s, name)
  local w = wanted[s]
  if not w then w = {{}, {}}; wanted[s] = w end
  if not w[2][name] then w[2][name] = true; w[1][#w[1] + 1] = name end
end
local i, at = FIRST, 1
while at <= #layout do
  local target, count
  target, count, at = struct.unpack('>i4>I4', layout, at)
  local c = place[target]
  local kept = c and not moved[c]
  for _ = 1, count do
    local check, old, fresh
    check, old, fresh, at = struct.unpack('>B>H>H', layout, at)
    local first, last = i + 1, i + old + fresh
    for f = first, (check == 1 and kept) and i + old or last do want(target, ARGV[f]) end
    if check == 1 and any then
      for m = 1, k do
        if moved[m] then
          for f = first, last do want(compared[m], ARGV[f]) end
        end
      end
    end
    i = last + 1
  end
end
local orig = {}  -- slice -> field -> value at the start of the call (nil: absent, or known absent)
for s, w in pairs(wanted) do
  local o, names = {}, w[1]
  for a = 1, #names, PER_CALL do
    local part = {unpack(names, a, math.min(a + PER_CALL - 1, #names))}
    local vs = redis.call('HMGET', KEYS[1 + s - lo], unpack(part))
    for b = 1, #part do o[part[b]] = vs[b] end
  end
  orig[s] = o
end
local function last(v)  -- the seq of a value's last record
  return struct.unpack('>I8', v, #v - 7)
end
local results = {}
local written = {}  -- slice -> field -> its value now
local q = 0  -- compared fields so far (their place in `seen`)
local width = 12 * k
i, at = FIRST, 1
while at <= #layout do
  local target, count
  target, count, at = struct.unpack('>i4>I4', layout, at)
  local base = orig[target] or {}
  local cur = written[target]
  if not cur then cur = {}; written[target] = cur end
  for _ = 1, count do
    local c1, old, fresh
    c1, old, fresh, at = struct.unpack('>B>H>H', layout, at)
    local rec, check = ARGV[i], c1 == 1
    local first, last_f = i + 1, i + old + fresh
    local result = check and 1 or -1
    for f = first, last_f do
      local name = ARGV[f]
      if check then
        if result == 1 and any then
          for c = 1, k do
            if moved[c] then
              local v = orig[compared[c]][name]
              local length = v and #v or 0
              local p = q * width + 12 * (c - 1) + 1
              local saw_length, saw_seq = struct.unpack('>I4', seen, p), struct.unpack('>I8', seen, p + 4)
              if length ~= saw_length or length > 0 and last(v) ~= saw_seq then
                result = -1
                break
              end
            end
          end
        end
        q = q + 1
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
    i = last_f + 1
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
for s, cur in pairs(written) do
  local args = {}
  for name, v in pairs(cur) do args[#args + 1] = name; args[#args + 1] = v end
  if #args > 0 then
    local m = mark(s) + 1
    if now > m then m = now end
    args[#args + 1] = 'w'
    args[#args + 1] = string.format('%.0f', m)
    for a = 1, #args, 2 * PER_CALL do
      redis.call('HSET', KEYS[1 + s - lo], unpack(args, a, math.min(a + 2 * PER_CALL - 1, #args)))
    end
    redis.call('PEXPIRE', KEYS[1 + s - lo], ttl)
  end
end
return results
