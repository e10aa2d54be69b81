-- Compare and swap one hash field: set it to ARGV[3] only if it still holds ARGV[2] ('' for a
-- field that is absent). Returns 1 if it was set, 0 if another client changed it first.
-- KEYS[1] = the hash, ARGV[1] = the field.
local now = redis.call('HGET', KEYS[1], ARGV[1])
if (now or '') ~= ARGV[2] then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
