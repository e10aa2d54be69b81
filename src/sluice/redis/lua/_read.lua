-- Shared by the read scripts (prepended after _merge.lua): the merge of one lookup's slices.
--
-- read_lookup(agg, k0, nk, a0) merges the slices of one (metric, key) held in the hashes
-- KEYS[k0 .. k0+nk-1] (one per resolution; one hash tag); for the i-th of them ARGV[a0+3i ..]
-- gives the first slice start, the last slice start and the slice length. agg is count | sum |
-- min | max | avg | var | last. Returns {slices_with_data, v1, v2, ...} as strings: the merged
-- state (see write_slices.lua), or just {'0'} when no slice in the ranges holds data.
local function read_lookup(agg, k0, nk, a0)
  local n, acc = 0, nil
  local function merge(packed)
    local _, v = parse_state(packed)
    n = n + 1
    if acc == nil then acc = v else acc = merge_state(agg, acc, v) end
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
        if s and s >= first and s <= last and (s - first) % slice_ms == 0 then
          merge(all[i + 1])
        end
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

  for k = 0, nk - 1 do
    local at = a0 + 3 * k
    read_range(KEYS[k0 + k], tonumber(ARGV[at]), tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2]))
  end
  if acc == nil then return {'0'} end
  local out = {tostring(n)}
  for j = 1, #acc do out[#out + 1] = fmt(acc[j]) end
  return out
end
