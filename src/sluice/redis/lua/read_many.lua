-- Many lookups in one call, each merged as read_slices.lua merges one. For one Redis only: on
-- a cluster the keys of different lookups sit in different slots, so each goes in its own call.
--
-- KEYS       every lookup's slice hashes, lookup after lookup
-- ARGV       per lookup: agg, its number of keys K, then per key: first, last, slice_ms
-- Returns one reply per lookup, in order, each as read_slices.lua's.
local results, k, a = {}, 1, 1
while a <= #ARGV do
  local agg, nk = ARGV[a], tonumber(ARGV[a + 1])
  results[#results + 1] = read_lookup(agg, k, nk, a + 2)
  k = k + nk
  a = a + 2 + 3 * nk
end
return results
