-- Shared by the compact layout's insert scripts (loaded in front of compact_insert.lua): a bucket value's
-- records are <ts: f64 LE><seq: u64 BE>, 16 bytes each, in insertion order.
-- Keeps the `cap` newest records (event time, then seq) of a bucket value, in insertion order.
local function trim16(v, cap)
  local n = #v / 16
  if n <= cap then return v end
  local recs = {}
  for j = 1, n do
    local p = (j - 1) * 16 + 1
    recs[j] = {struct.unpack('<d', v, p), string.sub(v, p + 8, p + 15), p}
  end
  local order = {}
  for j = 1, n do order[j] = recs[j] end
  table.sort(order, function(a, b) if a[1] ~= b[1] then return a[1] > b[1] end return a[2] > b[2] end)
  local keep = {}
  for j = 1, cap do keep[order[j]] = true end
  local out = {}
  for _, r in ipairs(recs) do
    if keep[r] then out[#out + 1] = string.sub(v, r[3], r[3] + 15) end
  end
  return table.concat(out)
end
