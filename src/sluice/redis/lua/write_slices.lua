-- Merge one batch's slice updates into the slice hashes of several (metric, key)s. Atomic.
--
-- KEYS[1..K]  slice hashes (on Redis Cluster the caller groups keys by slot)
-- ARGV[1]     writer token (epoch * 1e12 + batch id). A slice whose stored token is >= this one
--             already holds this batch's update, which is then skipped: replays are idempotent.
-- then, for each key in order:
--   state, slice_ms, retention_ms, n, width, and n times (slice_start, v1 .. v_width)
-- A slice is stored as "token:v1:...:v_width". The states (`Agg.state` in sluice/slices/aggs.py)
-- are the numeric ones listed in _merge.lua, and
--   blob: an opaque value (a sketch merged by the caller), replaced, never parsed
-- (Merging and number formatting come from _merge.lua, prepended.)
-- Field `_m` holds "hi:lo": the newest slice start and a lower bound of the oldest, for retention.
-- Returns {applied, duplicates, expired} summed over the keys.
local token = tonumber(ARGV[1])

local applied, dups, expired = 0, 0, 0
local p = 2
for k = 1, #KEYS do
  local key = KEYS[k]
  local agg = ARGV[p]
  local slice_ms = tonumber(ARGV[p + 1])
  local retention_ms = tonumber(ARGV[p + 2])
  local n = tonumber(ARGV[p + 3])
  local width = tonumber(ARGV[p + 4])
  local stride = width + 1
  local base = p + 5
  p = base + stride * n

  local fields = {'_m'}
  for i = 0, n - 1 do fields[#fields + 1] = ARGV[base + stride * i] end
  local old = redis.call('HMGET', key, unpack(fields))

  local hi, lo = -1e300, 1e300
  if old[1] then
    local h, l = string.match(old[1], '^([^:]+):(.+)$')
    hi, lo = tonumber(h), tonumber(l)
  end
  local old_hi = hi
  for i = 0, n - 1 do
    local s = tonumber(ARGV[base + stride * i])
    if s > hi then hi = s end
  end
  local keep_from = hi - retention_ms + slice_ms

  local out = {}
  for i = 0, n - 1 do
    local at = base + stride * i
    local field = ARGV[at]
    local s = tonumber(field)
    local prev = old[i + 2]
    if s < keep_from then
      expired = expired + 1
    else
      local prev_token = prev and tonumber(string.match(prev, '^([^:]+)'))
      if prev_token and prev_token >= token then
        dups = dups + 1
      else
        local packed
        if agg == 'blob' then
          packed = ARGV[1] .. ':' .. ARGV[at + 1]
        else
          local u = {}
          for j = 1, width do u[j] = tonumber(ARGV[at + j]) end
          if prev then
            local _, old_state = parse_state(prev)
            u = merge_state(agg, u, old_state)
          end
          packed = ARGV[1]
          for j = 1, width do packed = packed .. ':' .. fmt(u[j]) end
        end
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
