-- Record one committed batch's counters, at most once per writer token. Atomic.
--
-- KEYS[1]  stats hash   KEYS[2]  recent-batches list   KEYS[3]  (optional) freshness histogram
-- ARGV[1]  token   ARGV[2]  batch record (JSON)   ARGV[3..] repeated (counter, increment) for
-- KEYS[1]; after an argument "|", repeated (field, increment) for KEYS[3].
-- Returns 1 when recorded, 0 when this token was already recorded (a re-run batch).
local last = tonumber(redis.call('HGET', KEYS[1], 'last_token') or '-1')
if last >= tonumber(ARGV[1]) then return 0 end
local target = KEYS[1]
local i = 3
while i <= #ARGV do
  if ARGV[i] == '|' then
    target = KEYS[3]
    i = i + 1
  else
    redis.call('HINCRBY', target, ARGV[i], ARGV[i + 1])
    i = i + 2
  end
end
redis.call('HSET', KEYS[1], 'last_token', ARGV[1], 'last_batch', ARGV[2])
redis.call('LPUSH', KEYS[2], ARGV[2])
redis.call('LTRIM', KEYS[2], 0, 599)
return 1
