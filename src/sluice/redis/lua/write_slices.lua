-- Merge one batch's slice updates into the slice hashes of several keys of one metric
-- resolution. Atomic.
--
-- KEYS[1..K]  slice hashes (on Redis Cluster the caller groups keys by slot)
-- ARGV[1]     writer token (epoch * 1e12 + batch id). A slice whose stored token is >= this one
--             already holds this batch's update, which is then skipped: replays are idempotent.
--             Or `b<seam>`, a backfill (sluice/offline/backfill.py): its slices, all before the
--             seam (ms), *replace* what is stored (they hold every archived event of the slice,
--             so a re-run writes the same), and each key's seam field `_b` rises to it. The live
--             fold's updates of a slice before a key's `_b` are skipped (counted as
--             `before_seam`): before the seam the archive is the truth.
-- ARGV[2..6]  state, slice_ms, retention_ms, width, expiry step (ms)
-- ARGV[7]     the writer's reference time (ms): a live batch's, fixed when it was planned, or a
--             backfill's run time; empty for none (see `_m` below)
-- then per key k, one arg: the key's expiry (ms, as text) for its newest slice here (see
--             below), prefixed by "n_k:" when the key carries n_k > 1 slices (most keys carry
--             one, and an argument costs Redis more than the `find` that tells them apart);
-- then, per key in order, n_k times: slice_start, v1 .. v_width (numbers as exact text);
--             from a backfill, slice_start, the slice's text as stored ("0:v1:...:v_width"),
--             in ascending order of start, which go to HSET as they came (`backfill_run`).
-- A key may come more than once in a row (a long run of one key's slices cut by the writer).
-- A slice is stored as "token:v1:...:v_width". A slice that had no state stores the writer's
-- text as it is; a merged one the numbers as `fmt` writes them. The states (`Agg.state` in
-- sluice/slices/aggs.py) are the numeric ones listed in _merge.lua, and
--   blob: an opaque value (a sketch merged by the caller), replaced, never parsed
-- (Merging and number formatting come from _merge.lua, prepended.)
-- Field `_m` holds "hi:lo": the newest slice start and a lower bound of the oldest, for retention.
-- A key keeps its slices from hi - retention_ms on: a window as long as the retention that ends
-- inside the newest slice starts in the oldest of them. Older updates count as expired. Where hi
-- is ahead of the slice of the reference time (an event stamped in the future, up to the
-- source's max_future), that slice takes its place: a window of the whole retention ending now
-- keeps every slice it starts in, whatever a key holds ahead of now.
-- The hash expires once its newest slice is past retention: at hi + slice_ms + retention_ms,
-- rounded up to a multiple of the expiry step, so that a key whose newest slice moves on needs a
-- new PEXPIREAT only once per step. The writer sends that time for its own newest slice.
-- Returns {applied, duplicates, expired, before_seam} summed over the keys.
--
-- The work per key is kept to HMGET, HSET and, when its expiry moves, PEXPIREAT: a key with one
-- slice (most of them when keys are many) goes through a path without tables. Numbers are parsed
-- only where they are compared or merged (`tonumber` is strtod, the script's dearest step): a
-- new hash with one slice parses none, and `_m` is rebuilt from the texts it was made of.
-- Globals are table lookups on every use; the loop below uses these thousands of times a call.
local KEYS, ARGV, tonumber, unpack = KEYS, ARGV, tonumber, unpack
local token_s = ARGV[1]
local seam_s  -- a backfill's seam (text), or nil for the live fold
if sub(token_s, 1, 1) == 'b' then seam_s, token_s = sub(token_s, 2), '0' end
local token = tonumber(token_s)
local agg = ARGV[2]
local slice_ms = tonumber(ARGV[3])
local retention_ms = tonumber(ARGV[4])
local width = tonumber(ARGV[5])
local step = tonumber(ARGV[6])
local ref = tonumber(ARGV[7])
if ref then ref = ref - ref % slice_ms end
local stride = seam_s and 2 or width + 1
local call, ceil = redis.call, math.ceil
local applied, dups, expired, before_seam = 0, 0, 0, 0

-- The stored text of one slice update at ARGV[at] over `prev` (nil: none), or nil if `prev`
-- already holds this batch's update.
local function packed_of(at, prev)
  if not prev then
    if width == 1 then return token_s .. ':' .. ARGV[at + 1] end
    local packed = token_s
    for j = 1, width do packed = packed .. ':' .. ARGV[at + j] end
    return packed
  end
  local c = find(prev, ':', 1, true)
  if tonumber(sub(prev, 1, c - 1)) >= token then return nil end
  if agg == 'blob' then return token_s .. ':' .. ARGV[at + 1] end
  if width == 1 then  -- a one-number state: no tables
    local v = merge_single(agg, tonumber(ARGV[at + 1]), tonumber(sub(prev, c + 1)))
    if v then return token_s .. ':' .. fmt(v) end
  end
  local u = {}
  for j = 1, width do u[j] = tonumber(ARGV[at + j]) end
  local _, old_state = parse_state(prev)
  u = merge_state(agg, u, old_state)
  local packed = token_s
  for j = 1, width do packed = packed .. ':' .. fmt(u[j]) end
  return packed
end

-- The first slice a key keeps whose newest slice starts at hi (see `_m` above).
local function keep_from_of(hi)
  if ref and ref < hi then return ref - retention_ms end
  return hi - retention_ms
end

local function expiry_step(hi)
  return ceil((hi + slice_ms + retention_ms) / step)
end

-- Drop the slices in [lo, keep_from) (retention); returns the new lower bound.
local function trim(key, lo, keep_from)
  if (keep_from - lo) / slice_ms <= 4096 then
    local gone = {}
    local s = lo
    while s < keep_from do
      gone[#gone + 1] = fmt(s)
      if #gone == 1000 then
        call('HDEL', key, unpack(gone))
        gone = {}
      end
      s = s + slice_ms
    end
    if #gone > 0 then call('HDEL', key, unpack(gone)) end
  else
    for _, f in ipairs(call('HKEYS', key)) do
      local s = tonumber(f)
      if s and s < keep_from then call('HDEL', key, f) end
    end
  end
  return keep_from
end

-- A backfill's run of n slices of `key` from ARGV[base] (ascending, stored texts): the slices
-- within retention replace what is stored, in one HSET with `_m` and `_b`; no slice is parsed
-- but the run's first and last, and those below retention, which come first.
local function backfill_run(key, base, n, expire_at)
  local old = call('HMGET', key, '_m', '_b')
  local hi_s = ARGV[base + 2 * (n - 1)]
  local hi = tonumber(hi_s)
  local m, old_hi, old_lo, old_lo_s = old[1]
  if m then
    local c = find(m, ':', 1, true)
    local old_hi_s = sub(m, 1, c - 1)
    old_lo_s = sub(m, c + 1)
    old_hi, old_lo = tonumber(old_hi_s), tonumber(old_lo_s)
    if old_hi >= hi then hi, hi_s = old_hi, old_hi_s end
  end
  local keep_from = keep_from_of(hi)
  local first = 0  -- slices of the run below retention
  while first < n and tonumber(ARGV[base + 2 * first]) < keep_from do first = first + 1 end
  expired = expired + first
  local lo_s = first < n and ARGV[base + 2 * first] or nil
  if old_lo then
    if old_lo < keep_from then
      old_lo = trim(key, old_lo, keep_from)
      old_lo_s = fmt(old_lo)
    end
    if not lo_s or old_lo < tonumber(lo_s) then lo_s = old_lo_s end
  end
  if not lo_s then return end  -- nothing within retention, and no hash
  local b = old[2]
  if not b or tonumber(seam_s) > tonumber(b) then b = seam_s end
  if first < n then
    call('HSET', key, '_b', b, '_m', hi_s .. ':' .. lo_s,
         unpack(ARGV, base + 2 * first, base + 2 * n - 1))
    applied = applied + n - first
  else
    call('HSET', key, '_b', b, '_m', hi_s .. ':' .. lo_s)
  end
  if hi ~= old_hi and (not old_hi or expiry_step(hi) ~= expiry_step(old_hi)) then
    call('PEXPIREAT', key, expire_at)
  end
end

-- The live fold's run of n slice updates of `key` from ARGV[base]: merged over what is stored.
local function live_run(key, base, n, expire_at)
  local old, hi, hi_s, starts
  if n == 1 then
    old = call('HMGET', key, '_m', '_b', ARGV[base])
  else
    local fields = {'_m', '_b'}
    starts = {}
    hi = -1e300
    for i = 1, n do
      local f = ARGV[base + stride * (i - 1)]
      fields[i + 2] = f
      local s = tonumber(f)
      starts[i] = s
      if s > hi then hi, hi_s = s, f end
    end
    old = call('HMGET', key, unpack(fields))
  end
  local m = old[1]
  -- The key's seam: slices before it are the backfill's.
  local key_seam = old[2] and tonumber(old[2])
  if not m and n == 1 and not key_seam then
    -- A new hash with one slice: no retention to apply, and `_m` is that slice twice.
    local f = ARGV[base]
    local packed = packed_of(base, old[3])
    if packed then
      call('HSET', key, f, packed, '_m', f .. ':' .. f)
      applied = applied + 1
    else
      call('HSET', key, '_m', f .. ':' .. f)
      dups = dups + 1
    end
    call('PEXPIREAT', key, expire_at)
  else
    local one  -- the start of a key's only slice (its numbers are parsed once)
    if n == 1 then
      hi_s = ARGV[base]
      hi = tonumber(hi_s)
      one = hi
    end
    -- `_m` is rewritten from the texts it was made of (the stored one, or a slice start as the
    -- writer sent it): no number is formatted unless retention moved its lower bound.
    local old_hi, old_lo, lo_s
    if m then
      local c = find(m, ':', 1, true)
      local old_hi_s
      old_hi_s, lo_s = sub(m, 1, c - 1), sub(m, c + 1)
      old_hi, old_lo = tonumber(old_hi_s), tonumber(lo_s)
      if old_hi >= hi then hi, hi_s = old_hi, old_hi_s end
    end
    local lo = old_lo or 1e300
    local keep_from = keep_from_of(hi)
    local out, o = {}, 0
    for i = 1, n do
      local at = base + stride * (i - 1)
      local s = one or starts[i]
      if s < keep_from then
        expired = expired + 1
      elseif key_seam and s < key_seam then
        before_seam = before_seam + 1
      else
        local packed = packed_of(at, old[i + 2])
        if packed then
          out[o + 1] = ARGV[at]
          out[o + 2] = packed
          o = o + 2
          if s < lo then lo, lo_s = s, ARGV[at] end
          applied = applied + 1
        else
          dups = dups + 1
        end
      end
    end
    if lo < keep_from then
      lo = trim(key, lo, keep_from)
      lo_s = fmt(lo)
    end
    if hi ~= old_hi or lo ~= old_lo then
      out[o + 1] = '_m'
      out[o + 2] = hi_s .. ':' .. (lo_s or fmt(lo))
      o = o + 2
    end
    if o > 0 then call('HSET', key, unpack(out)) end
    if hi ~= old_hi and (not old_hi or expiry_step(hi) ~= expiry_step(old_hi)) then
      call('PEXPIREAT', key, expire_at)
    end
  end
end

local p = 8 + #KEYS
for k = 1, #KEYS do
  local key = KEYS[k]
  local expire_at, n = ARGV[7 + k], 1
  local c = find(expire_at, ':', 1, true)
  if c then n, expire_at = tonumber(sub(expire_at, 1, c - 1)), sub(expire_at, c + 1) end
  local base = p
  p = base + stride * n
  if seam_s then
    backfill_run(key, base, n, expire_at)
  else
    live_run(key, base, n, expire_at)
  end
end
return {applied, dups, expired, before_seam}
