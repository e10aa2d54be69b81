-- Merge ranges of slices of one (metric, key), server-side, possibly over several resolutions.
--
-- KEYS[1..K]  slice hashes (one per range: the metric's hash for each resolution; one hash tag)
-- ARGV[1]     agg (count | sum | min | max | avg | var | last)
-- then, per key in order: first slice start, last slice start, slice_ms
-- Returns {slices_with_data, v1, v2, ...} as strings: the merged state (see write_slices.lua),
-- or just {'0'} when no slice in the ranges holds data.
local agg = ARGV[1]

local function fmt(x)
  if x == math.floor(x) and math.abs(x) < 1e15 then
    return string.format('%d', x)
  end
  return string.format('%.17g', x)
end

local n, acc = 0, nil
local function merge(packed)
  local v = {}
  local i = 0
  for part in string.gmatch(packed, '[^:]+') do
    if i > 0 then v[i] = tonumber(part) end
    i = i + 1
  end
  n = n + 1
  if acc == nil then
    acc = v
  elseif agg == 'count' or agg == 'sum' then
    acc[1] = acc[1] + v[1]
  elseif agg == 'min' then
    if v[1] < acc[1] then acc[1] = v[1] end
  elseif agg == 'max' then
    if v[1] > acc[1] then acc[1] = v[1] end
  elseif agg == 'avg' then
    acc[1] = acc[1] + v[1]; acc[2] = acc[2] + v[2]
  elseif agg == 'var' then
    local na, ma, qa = acc[1], acc[2], acc[3]
    local nb, mb, qb = v[1], v[2], v[3]
    local total = na + nb
    local delta = mb - ma
    acc[1] = total
    acc[2] = ma + delta * nb / total
    acc[3] = qa + qb + delta * delta * na * nb / total
  elseif agg == 'last' then
    if v[1] > acc[1] or (v[1] == acc[1] and v[2] > acc[2]) then acc = v end
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
if acc == nil then return {'0'} end
local out = {tostring(n)}
for j = 1, #acc do out[#out + 1] = fmt(acc[j]) end
return out
