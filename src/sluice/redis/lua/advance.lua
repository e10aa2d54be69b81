-- Find how far one stream shard may advance under an event budget (admission control).
--
-- KEYS[1]  stream
-- ARGV[1]  start id (exclusive)   ARGV[2] event budget   ARGV[3] format: fields | jsonl
-- ARGV[4]  1: admit the first entry even when it alone is over the budget (progress), else 0
-- Walks entries after start in chunks, counting events (1 per entry for `fields`; field `n`,
-- else the line count of `d`, for `jsonl`), and stops before the entry that would exceed the
-- budget. With ARGV[4] = 1 the first entry is always admitted, so one over the budget cannot stall
-- the stream. Returns {end_id, entries, events, more}: end_id is the start id when nothing is
-- new; more is 1 when the budget, not the end of the stream, stopped the walk.
-- Only the end id travels back to the client; the entries stay on the server.
local key = KEYS[1]
local cursor = ARGV[1]
local budget = tonumber(ARGV[2])
local jsonl = ARGV[3] == 'jsonl'
local force_first = ARGV[4] ~= '0'
local end_id = cursor
local entries, events, more = 0, 0, 0

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
  if want <= 0 then
    if #redis.call('XRANGE', key, '(' .. cursor, '+', 'COUNT', 1) > 0 then more = 1 end
    break
  end
  if want > 1000 then want = 1000 end
  local batch = redis.call('XRANGE', key, '(' .. cursor, '+', 'COUNT', want)
  if #batch == 0 then break end
  local stop = false
  for _, entry in ipairs(batch) do
    local n = count_events(entry[2])
    if (entries > 0 or not force_first) and events + n > budget then
      stop = true
      more = 1
      break
    end
    entries = entries + 1
    events = events + n
    end_id = entry[1]
  end
  if stop then break end
  cursor = batch[#batch][1]
end
return {end_id, entries, events, more}
