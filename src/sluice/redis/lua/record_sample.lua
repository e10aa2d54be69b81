-- Keep the first history sample of each second, whoever took it. Atomic.
--
-- KEYS[1]  history list (newest first)   KEYS[2]  the second of the newest sample
-- ARGV[1]  this sample's second   ARGV[2]  the sample (JSON)   ARGV[3]  samples kept
-- Returns 1 when the sample was kept, 0 when this second (or a later one) already has one.
local last = tonumber(redis.call('GET', KEYS[2]) or '-1')
if last >= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[2], ARGV[1])
redis.call('LPUSH', KEYS[1], ARGV[2])
redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[3]) - 1)
return 1
