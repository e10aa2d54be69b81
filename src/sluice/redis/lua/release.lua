-- Record one reader's committed id in a stream shard, and trim the shard up to its slowest
-- reader. Atomic, so two readers committing at once cannot trim past either of them.
--
-- KEYS[1]  stream shard   KEYS[2]  the shard's reader hash (reader name -> committed id)
-- ARGV[1]  this reader's name   ARGV[2]  its committed id
-- ARGV[3..] the names of every reader of the shard, this one included
-- The stored id only moves forward (a replayed or older commit leaves it). When every listed
-- reader has an id, the shard is trimmed with MINID to the smallest: MINID keeps that entry,
-- and its reader excludes it from its next batch by its offset. A listed reader that has never
-- committed blocks trimming. Returns the trim id, or false when nothing was trimmed.

-- Ids are "<ms>-<seq>" decimal strings; numbers compare by length, then digit by digit, which
-- stays exact past 2^53 (Lua numbers are doubles).
local function num_less(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end

local function id_less(a, b)
  local a_ms, a_seq = string.match(a, '^(%d+)-(%d+)$')
  local b_ms, b_seq = string.match(b, '^(%d+)-(%d+)$')
  if a_ms ~= b_ms then return num_less(a_ms, b_ms) end
  return num_less(a_seq, b_seq)
end

local shard, readers = KEYS[1], KEYS[2]
local name, id = ARGV[1], ARGV[2]
if not string.match(id, '^%d+-%d+$') then
  return redis.error_reply('release: committed id ' .. id .. ' is not <ms>-<seq>')
end
local stored = redis.call('HGET', readers, name)
if not stored or id_less(stored, id) then
  redis.call('HSET', readers, name, id)
end

if #ARGV < 3 then return false end
local names = {}
for i = 3, #ARGV do names[#names + 1] = ARGV[i] end
local min = nil
for _, v in ipairs(redis.call('HMGET', readers, unpack(names))) do
  if not v then return false end
  if min == nil or id_less(v, min) then min = v end
end
redis.call('XTRIM', shard, 'MINID', min)
return min
