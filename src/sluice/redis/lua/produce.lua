-- Append a producer's frames of events to one stream shard, each at most once. Atomic.
--
-- KEYS[1]  the stream shard   KEYS[2]  this producer's mark for it (same slot): the highest
--          frame number it has appended there
-- ARGV[1]  the mark's ttl (seconds); then per frame, in ascending order of number: its number,
--          how many entries it has, and per entry how many fields, then each name and value
-- A frame whose number is not above the mark was appended by an earlier call whose reply the
-- producer did not get (a timeout, a connection cut, a Redis paused or killed after the write):
-- it is skipped, so a retried flush writes each event once. Returns the entries appended.
local done = tonumber(redis.call('GET', KEYS[2]) or '0')
local top, at, added = done, 2, 0
local xadd, unpack = redis.call, unpack
while at <= #ARGV do
  local seq, n = tonumber(ARGV[at]), tonumber(ARGV[at + 1])
  at = at + 2
  for _ = 1, n do
    local k = tonumber(ARGV[at])
    if seq > done then
      xadd('XADD', KEYS[1], '*', unpack(ARGV, at + 1, at + 2 * k))
      added = added + 1
    end
    at = at + 1 + 2 * k
  end
  if seq > top then top = seq end
end
redis.call('SET', KEYS[2], top, 'EX', ARGV[1])
return added
