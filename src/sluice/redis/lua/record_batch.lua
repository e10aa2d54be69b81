-- Record one committed batch's counters, at most once per writer token. Atomic.
--
-- KEYS[1]  stats hash   KEYS[2]  recent-batches list
-- ARGV[1]  token   ARGV[2]  batch record (JSON)   ARGV[3..] repeated (counter, increment)
-- Returns 1 when recorded, 0 when this token was already recorded (a re-run batch).
local last = tonumber(redis.call('HGET', KEYS[1], 'last_token') or '-1')
if last >= tonumber(ARGV[1]) then return 0 end
for i = 3, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('HSET', KEYS[1], 'last_token', ARGV[1], 'last_batch', ARGV[2])
redis.call('LPUSH', KEYS[2], ARGV[2])
redis.call('LTRIM', KEYS[2], 0, 599)
return 1
