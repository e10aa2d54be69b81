-- Record one reader's committed offset in one Kafka partition, and return the smallest offset
-- over the partition's readers (what may be committed to the consumer group).
--
-- KEYS[1]  the partition's reader hash (reader name -> committed offset)
-- ARGV[1]  this reader's name   ARGV[2]  its committed offset (the next offset it reads)
-- ARGV[3]  '1' if the partition was read again from its start (created again), else '0'
-- ARGV[4..] the names of every reader of the partition, this one included
-- The stored offset only moves forward, but after a reset. Returns the smallest offset when
-- every listed reader has one, else false (a reader that has never committed holds the group
-- back).
local name, offset = ARGV[1], tonumber(ARGV[2])
local stored = tonumber(redis.call('HGET', KEYS[1], name))
if not stored or stored < offset or ARGV[3] == '1' then
  redis.call('HSET', KEYS[1], name, ARGV[2])
end
if #ARGV < 4 then return false end
local names = {}
for i = 4, #ARGV do names[#names + 1] = ARGV[i] end
local min = nil
for _, v in ipairs(redis.call('HMGET', KEYS[1], unpack(names))) do
  if not v then return false end
  local n = tonumber(v)
  if min == nil or n < min then min = n end
end
return min
