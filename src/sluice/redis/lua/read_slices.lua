-- Merge the slices [first, last] (step slice_ms) of one slice hash, server-side.
--
-- KEYS[1]  slice hash
-- ARGV[1]  agg   ARGV[2] first slice start   ARGV[3] last slice start   ARGV[4] slice_ms
-- Returns {n_slices_with_data, a, b} as strings; a and b are '' when no slice had data.
local key = KEYS[1]
local agg = ARGV[1]
local first = tonumber(ARGV[2])
local last = tonumber(ARGV[3])
local slice_ms = tonumber(ARGV[4])

local function fmt(x)
  if x == math.floor(x) and math.abs(x) < 1e15 then
    return string.format('%d', x)
  end
  return string.format('%.17g', x)
end

local n, a, b = 0, nil, 0
local function merge(packed)
  local _, va, vb = string.match(packed, '^([^:]+):([^:]+):?(.*)$')
  va = tonumber(va)
  n = n + 1
  if a == nil then
    a = va
    if agg == 'avg' then b = tonumber(vb) end
  elseif agg == 'count' or agg == 'sum' then
    a = a + va
  elseif agg == 'min' then
    if va < a then a = va end
  elseif agg == 'max' then
    if va > a then a = va end
  elseif agg == 'avg' then
    a = a + va
    b = b + tonumber(vb)
  end
end

local wanted = (last - first) / slice_ms + 1
local size = redis.call('HLEN', key)
if size == 0 then
  return {'0', '', ''}
end
if wanted > size then
  -- Sparse hash, long window: scan what exists instead of asking for every slice.
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local s = tonumber(all[i])
    if s and s >= first and s <= last and (s - first) % slice_ms == 0 then merge(all[i + 1]) end
  end
else
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
if a == nil then return {'0', '', ''} end
return {tostring(n), fmt(a), fmt(b)}
