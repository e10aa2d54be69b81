-- Shared by the slice scripts (prepended by sluice.redis.scripts): number formatting, and the
-- one definition of how two slice states merge. A state is an array of numbers; per state name
-- (which agg uses which state is in sluice/slices/aggs.py, `Agg.state`):
--   count: n   sum: s   min: m   max: m   avg: n, s   var: n, mean, m2
--   last: ts, value   first: ts, value

local function fmt(x)
  if x == math.floor(x) and math.abs(x) < 1e15 then
    return string.format('%d', x)
  end
  return string.format('%.17g', x)
end

local find, sub, tonumber = string.find, string.sub, tonumber

-- "token:v1:v2:..." -> token, {v1, v2, ...}. Plain finds, no patterns: the read script calls
-- this once per slice it merges.
local function parse_state(packed)
  local vals, i = {}, find(packed, ':', 1, true)
  local token = tonumber(sub(packed, 1, i - 1))
  while i do
    local j = find(packed, ':', i + 1, true)
    vals[#vals + 1] = tonumber(sub(packed, i + 1, j and j - 1))
    i = j
  end
  return token, vals
end

-- v1 of "token:v1", for the one-number states (count, sum, min, max), without a table.
local function single_value(packed)
  return tonumber(sub(packed, find(packed, ':', 1, true) + 1))
end

-- The merge of the one-number states a and b (count, sum, min, max); nil for another state.
local function merge_single(agg, a, b)
  if agg == 'count' or agg == 'sum' then return a + b end
  if agg == 'min' then return b < a and b or a end
  if agg == 'max' then return b > a and b or a end
  return nil
end

-- The merge of states a and b (commutative). May reuse a.
local function merge_state(agg, a, b)
  local single = #a == 1 and merge_single(agg, a[1], b[1])
  if single then
    a[1] = single
  elseif agg == 'avg' then
    a[1] = a[1] + b[1]
    a[2] = a[2] + b[2]
  elseif agg == 'var' then
    -- Chan et al.'s parallel update of (count, mean, sum of squared deviations).
    local n = a[1] + b[1]
    local delta = b[2] - a[2]
    a[1], a[2], a[3] = n, a[2] + delta * b[1] / n, a[3] + b[3] + delta * delta * a[1] * b[1] / n
  elseif agg == 'last' then
    -- The greater event time wins; a tie goes to the greater value.
    if b[1] > a[1] or (b[1] == a[1] and b[2] > a[2]) then a = b end
  elseif agg == 'first' then
    -- The smaller event time wins; a tie goes to the smaller value.
    if b[1] < a[1] or (b[1] == a[1] and b[2] < a[2]) then a = b end
  else
    error('no merge for slice state ' .. tostring(agg))
  end
  return a
end
