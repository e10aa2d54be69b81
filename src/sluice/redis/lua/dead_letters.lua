-- Append one partition's dead letters for one batch, at most once. Atomic.
--
-- KEYS[1]  marker (same hash tag as the stream)   KEYS[2]  dead-letter stream
-- ARGV[1]  marker ttl seconds   ARGV[2]  approximate MAXLEN of the stream
-- ARGV[3..] repeated (id, idx, reason, field, raw, ts, batch)
-- Returns 1 when written, 0 when an earlier attempt of the same batch already wrote them.
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) == false then
  return 0
end
for i = 3, #ARGV, 7 do
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*',
    'id', ARGV[i], 'idx', ARGV[i + 1], 'reason', ARGV[i + 2], 'field', ARGV[i + 3],
    'raw', ARGV[i + 4], 'ts', ARGV[i + 5], 'batch', ARGV[i + 6])
end
return 1
