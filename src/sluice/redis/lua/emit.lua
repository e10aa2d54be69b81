-- Append one chunk of a stage's output for one batch, at most once. Atomic.
--
-- KEYS[1]  marker (same slot as the stream)   KEYS[2]  the output stream shard
-- ARGV[1]  marker ttl seconds   ARGV[2..]  one `jsonl` entry each (its field `d`)
-- Returns the number of entries added, or -1 when an earlier attempt of the same batch
-- already wrote this chunk.
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) == false then
  return -1
end
for i = 2, #ARGV do
  redis.call('XADD', KEYS[2], '*', 'd', ARGV[i])
end
return #ARGV - 1
