-- Merge one batch's slice updates into the slice hashes of several (metric, key)s. Atomic.
--
-- KEYS[1..K]  slice hashes (on Redis Cluster the caller groups keys by slot)
-- ARGV[1]     writer token (epoch * 1e12 + batch id). A slice whose stored token is >= this one
--             already holds this batch's update, which is then skipped: replays are idempotent.
-- then, for each key in order:
--   agg (count | sum | min | max | avg), slice_ms, retention_ms, n,
--   and n times (slice_start, a, b); b is used by avg only (a = count, b = sum)
-- A slice is stored as "token:a" ("token:a:b" for avg); field `_m` holds "hi:lo", the newest
-- slice start and a lower bound of the oldest one, for retention.
-- Returns {applied, duplicates, expired} summed over the keys.
local token = tonumber(ARGV[1])

local function fmt(x)
  if x == math.floor(x) and math.abs(x) < 1e15 then
    return string.format('%d', x)
  end
  return string.format('%.17g', x)
end

local applied, dups, expired = 0, 0, 0
local p = 2
for k = 1, #KEYS do
  local key = KEYS[k]
  local agg = ARGV[p]
  local slice_ms = tonumber(ARGV[p + 1])
  local retention_ms = tonumber(ARGV[p + 2])
  local n = tonumber(ARGV[p + 3])
  local base = p + 4
  p = base + 3 * n

  local fields = {'_m'}
  for i = 0, n - 1 do fields[#fields + 1] = ARGV[base + 3 * i] end
  local old = redis.call('HMGET', key, unpack(fields))

  local hi, lo = -1e300, 1e300
  if old[1] then
    local h, l = string.match(old[1], '^([^:]+):(.+)$')
    hi, lo = tonumber(h), tonumber(l)
  end
  local old_hi = hi
  for i = 0, n - 1 do
    local s = tonumber(ARGV[base + 3 * i])
    if s > hi then hi = s end
  end
  local keep_from = hi - retention_ms + slice_ms

  local out = {}
  for i = 0, n - 1 do
    local field = ARGV[base + 3 * i]
    local s = tonumber(field)
    local a = tonumber(ARGV[base + 3 * i + 1])
    local b = tonumber(ARGV[base + 3 * i + 2])
    local prev = old[i + 2]
    if s < keep_from then
      expired = expired + 1
    else
      local skip = false
      if prev then
        local t, oa, ob = string.match(prev, '^([^:]+):([^:]+):?(.*)$')
        if tonumber(t) >= token then
          skip = true
        else
          oa = tonumber(oa)
          if agg == 'count' or agg == 'sum' then
            a = a + oa
          elseif agg == 'min' then
            if oa < a then a = oa end
          elseif agg == 'max' then
            if oa > a then a = oa end
          elseif agg == 'avg' then
            a = a + oa
            b = b + tonumber(ob)
          end
        end
      end
      if skip then
        dups = dups + 1
      else
        local packed = ARGV[1] .. ':' .. fmt(a)
        if agg == 'avg' then packed = packed .. ':' .. fmt(b) end
        out[#out + 1] = field
        out[#out + 1] = packed
        if s < lo then lo = s end
        applied = applied + 1
      end
    end
  end

  -- Retention: drop the slices that fell behind the newest one by more than retention_ms.
  if lo < keep_from then
    local count = (keep_from - lo) / slice_ms
    if count <= 4096 then
      local gone = {}
      local s = lo
      while s < keep_from do
        gone[#gone + 1] = fmt(s)
        if #gone == 1000 then
          redis.call('HDEL', key, unpack(gone))
          gone = {}
        end
        s = s + slice_ms
      end
      if #gone > 0 then redis.call('HDEL', key, unpack(gone)) end
    else
      for _, f in ipairs(redis.call('HKEYS', key)) do
        local s = tonumber(f)
        if s and s < keep_from then redis.call('HDEL', key, f) end
      end
    end
    lo = keep_from
  end
  out[#out + 1] = '_m'
  out[#out + 1] = fmt(hi) .. ':' .. fmt(lo)
  redis.call('HSET', key, unpack(out))
  if hi ~= old_hi then
    redis.call('PEXPIREAT', key, fmt(hi + slice_ms + retention_ms))
  end
end
return {applied, dups, expired}
