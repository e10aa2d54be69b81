-- The completeness audit's source side: which events a batch admitted, read from the stream
-- itself, independently of the Spark plan.
--
-- KEYS[1]  stream
-- ARGV[1]  from id (exclusive)   ARGV[2] to id (inclusive)   ARGV[3] format: fields | jsonl
-- ARGV[4]  max entry bytes       ARGV[5] at most this many entries per call
-- Returns {last_id, id1, n1, id2, n2, ...}: each entry's id and its number of events; last_id is
-- where the next call starts ("" when the range is done). For `fields` every entry is one event,
-- so only the ids are returned: {last_id, id1, id2, ...}.
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
  local size = 0
  for i = 1, #fields do size = size + #fields[i] end
  local map = {}
  for i = 1, #fields, 2 do map[fields[i]] = fields[i + 1] end
  if size > max_bytes then
    -- A repeated field name keeps its last value: only surviving pairs count toward the size.
    size = 0
    for name, value in pairs(map) do size = size + #name + #value end
    if size > max_bytes then return 1 end
  end
  local d = map['d']
  if d == nil then return 1 end
  -- Count lines holding a non-space character without cutting substrings: two C-level finds
  -- per line and no garbage, so the cost stays linear in the payload.
  local n, pos, len = 0, 1, #d
  while pos <= len do
    local ns = string.find(d, '%S', pos)
    if ns == nil then break end
    local nl = string.find(d, '\n', ns, true)
    n = n + 1
    if nl == nil then break end
    pos = nl + 1
  end
  if n == 0 then return 1 end
  return n
end

local entries = redis.call('XRANGE', key, '(' .. from, to, 'COUNT', limit)
local out = {''}
if jsonl then
  for _, entry in ipairs(entries) do
    out[#out + 1] = entry[1]
    out[#out + 1] = count(entry[2])
  end
else
  for _, entry in ipairs(entries) do out[#out + 1] = entry[1] end
end
if #entries == limit then out[1] = entries[#entries][1] end
return out
