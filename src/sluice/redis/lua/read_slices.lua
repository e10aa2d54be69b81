-- Merge ranges of slices of one (metric, key), server-side, possibly over several resolutions.
--
-- KEYS[1..K]  slice hashes (one per range: the metric's hash for each resolution; one hash tag)
-- ARGV[1]     agg (count | sum | min | max | avg | var | last)
-- then, per key in order: first slice start, last slice start, slice_ms
-- Returns read_lookup's reply (see _read.lua).
return read_lookup(ARGV[1], 1, #KEYS, 2)
