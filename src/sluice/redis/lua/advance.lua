-- Find how far one stream shard may advance under an event budget (admission control).
--
-- KEYS[1]  stream
-- ARGV[1]  start id (exclusive)   ARGV[2] event budget   ARGV[3] format: fields | jsonl
-- Walks entries after start in chunks, counting events (1 per entry for `fields`; field `n`,
-- else the line count of `d`, for `jsonl`), and stops before the entry that would exceed the
-- budget. The first entry is always admitted, so an entry larger than the budget cannot stall
-- the stream. Returns {end_id, entries, events}; end_id is the start id when nothing is new.
-- Only the end id travels back to the client; the entries stay on the server.
local key = KEYS[1]
local cursor = ARGV[1]
local budget = tonumber(ARGV[2])
local jsonl = ARGV[3] == 'jsonl'
local end_id = cursor
local entries, events = 0, 0

local function count_events(fields)
  if not jsonl then return 1 end
  local d = nil
  for i = 1, #fields, 2 do
    if fields[i] == 'n' then
      local n = tonumber(fields[i + 1])
      if n and n >= 1 then return n end
    elseif fields[i] == 'd' then
      d = fields[i + 1]
    end
  end
  if d == nil then return 1 end
  local _, newlines = string.gsub(d, '\n', '\n')
  return newlines + 1
end

while true do
  local want = budget - events
  if want <= 0 then break end
  if want > 1000 then want = 1000 end
  local batch = redis.call('XRANGE', key, '(' .. cursor, '+', 'COUNT', want)
  if #batch == 0 then break end
  local stop = false
  for _, entry in ipairs(batch) do
    local n = count_events(entry[2])
    if entries > 0 and events + n > budget then
      stop = true
      break
    end
    entries = entries + 1
    events = events + n
    end_id = entry[1]
  end
  if stop then break end
  cursor = batch[#batch][1]
end
return {end_id, entries, events}
