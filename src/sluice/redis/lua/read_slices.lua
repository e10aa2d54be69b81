-- Merge ranges of slices of one (metric, key), server-side, possibly over several resolutions.
--
-- KEYS[1..K]  slice hashes (one per range: the metric's hash for each resolution; one hash tag)
-- ARGV[1]     state name (count | sum | min | max | avg | var | last | first: `Agg.state`)
-- then, per key in order: first slice start, last slice start, slice_ms
-- Returns {slices_with_data, v1, v2, ...} as strings: the merged state (see write_slices.lua),
-- or just {'0'} when no slice in the ranges holds data. Merging comes from _merge.lua.
local agg = ARGV[1]

-- One-number states are merged into `one`, without a table per slice; the others into `acc`.
local n, acc, one = 0, nil, nil
local merge
if agg == 'count' or agg == 'sum' then
  merge = function(packed)
    local v = single_value(packed)
    n = n + 1
    if one == nil then one = v else one = one + v end
  end
elseif agg == 'min' or agg == 'max' then
  local lower = agg == 'min'
  merge = function(packed)
    local v = single_value(packed)
    n = n + 1
    if one == nil or (lower and v < one) or (not lower and v > one) then one = v end
  end
else
  merge = function(packed)
    local _, v = parse_state(packed)
    n = n + 1
    if acc == nil then acc = v else acc = merge_state(agg, acc, v) end
  end
end

local function read_range(key, first, last, slice_ms)
  local size = redis.call('HLEN', key)
  if size == 0 then return end
  local wanted = (last - first) / slice_ms + 1
  if wanted > size then
    -- Sparse hash, long range: scan what exists instead of asking for every slice.
    local all = redis.call('HGETALL', key)
    for i = 1, #all, 2 do
      local s = tonumber(all[i])
      if s and s >= first and s <= last and (s - first) % slice_ms == 0 then merge(all[i + 1]) end
    end
    return
  end
  local fields = {}
  local s = first
  while s <= last do
    fields[#fields + 1] = fmt(s)
    if #fields == 2000 or s + slice_ms > last then
      local vals = redis.call('HMGET', key, unpack(fields))
      for j = 1, #vals do
        if vals[j] then merge(vals[j]) end
      end
      fields = {}
    end
    s = s + slice_ms
  end
end

for k = 1, #KEYS do
  local at = 2 + 3 * (k - 1)
  read_range(KEYS[k], tonumber(ARGV[at]), tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2]))
end
if one ~= nil then acc = {one} end
if acc == nil then return {'0'} end
local out = {tostring(n)}
for j = 1, #acc do out[#out + 1] = fmt(acc[j]) end
return out
