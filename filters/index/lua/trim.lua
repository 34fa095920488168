-- Shared by the insert scripts (loaded in front of insert.lua and spread_claim.lua): a bucket value's
-- records are <ts: f64 LE><id length: u32 LE><id><seq: u64 BE>, in insertion order.
-- Keeps the `cap` newest records (event time, then seq) of a bucket value, in insertion order.
local function trim(v, cap)
  local recs, p = {}, 1
  while p <= #v do
    local ts, n = struct.unpack('<dI4', v, p)
    local stop = p + 12 + n + 7
    recs[#recs + 1] = {ts, string.sub(v, stop - 7, stop), p, stop}
    p = stop + 1
  end
  if #recs <= cap then return v end
  local order = {}
  for j = 1, #recs do order[j] = recs[j] end
  table.sort(order, function(a, b) if a[1] ~= b[1] then return a[1] > b[1] end return a[2] > b[2] end)
  local keep = {}
  for j = 1, cap do keep[order[j]] = true end
  local out = {}
  for _, r in ipairs(recs) do
    if keep[r] then out[#out + 1] = string.sub(v, r[3], r[4]) end
  end
  return table.concat(out)
end
