-- The completeness audit's source side: which events a batch admitted, read from the stream
-- itself, independently of the Spark plan.
--
-- KEYS[1]  stream
-- ARGV[1]  from id (exclusive)   ARGV[2] to id (inclusive)   ARGV[3] format: fields | jsonl
-- ARGV[4]  max entry bytes       ARGV[5] at most this many entries per call
-- Returns {last_id, id1, n1, id2, n2, ...}: each entry's id and its number of events; last_id is
-- where the next call starts ("" when the range is done).
--
-- The event count is source.decode.entry_event_count, exactly:
--   an entry over max entry bytes (names + values) is 1 event; a `fields` entry is 1;
--   a `jsonl` entry is its lines of `d` (split on \n) that hold a non-space character, or 1
--   when it has none or no `d`. (%S is C's not-isspace: the set Python's bytes.strip removes.)
local key, from, to = KEYS[1], ARGV[1], ARGV[2]
local jsonl = ARGV[3] == 'jsonl'
local max_bytes = tonumber(ARGV[4])
local limit = tonumber(ARGV[5])

local function count(fields)
  -- A repeated field name keeps its last value, and only surviving pairs count toward the size.
  local map = {}
  for i = 1, #fields, 2 do map[fields[i]] = fields[i + 1] end
  local size = 0
  for name, value in pairs(map) do size = size + #name + #value end
  if size > max_bytes or not jsonl then return 1 end
  local d = map['d']
  if d == nil then return 1 end
  local n = 0
  for line in string.gmatch(d, '[^\n]+') do
    if string.find(line, '%S') then n = n + 1 end
  end
  if n == 0 then return 1 end
  return n
end

local entries = redis.call('XRANGE', key, '(' .. from, to, 'COUNT', limit)
local out = {''}
for _, entry in ipairs(entries) do
  out[#out + 1] = entry[1]
  out[#out + 1] = count(entry[2])
end
if #entries == limit then out[1] = entries[#entries][1] end
return out
