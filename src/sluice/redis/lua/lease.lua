-- Leadership leases of streaming queries, and the writer epoch of each batch (pipeline.lease).
-- Every key shares the tag {lease}. Times are epoch ms from the caller's clock (ARGV[2]).
-- A lease is a hash that outlives its expiry, so the last holder is known: owner, epoch,
-- expires_ms, acquired_ms, renewed_ms, host, pid, conn (the name of the holder's connection),
-- checkpoint (its path), ckpt (its id).
--
-- ARGV[1] is the operation:
--   acquire  KEYS: the leases   ARGV: op, now, ttl_ms, owner, epoch, host, pid, conn, gone, then
--            per lease its checkpoint's path and id. `gone` names an owner whose connection
--            was seen closed: its leases count as lapsed ('' for none)
--            {1}            taken (or already ours: renewed)
--            {0, i, ...}    lease i is held by another owner until its expiry; its fields follow
--            {-1, e}        `epoch` is not above e, the newest epoch of these leases: take a
--                           newer one and call again (nothing was written)
--   renew    KEYS: the leases   ARGV: op, now, ttl_ms, owner        1, or 0 if one is not ours
--   release  KEYS: the leases   ARGV: op, now, owner                the number released
--   begin    KEYS: lease, terms ARGV: op, now, owner, ckpt, ckpt_epoch, last_planned
--            1 (terms begun for checkpoint `ckpt`), 0 (kept already), -1 (the lease is not ours)
--   epoch    KEYS: lease, terms ARGV: op, now, owner, batch, ckpt, ckpt_epoch
--            the epoch batch `batch` writes with; -1 when the lease is not ours, -2 when terms
--            were not begun for this checkpoint
local op, now = ARGV[1], tonumber(ARGV[2])

if op == 'acquire' then
  local owner, epoch = ARGV[4], tonumber(ARGV[5])
  local newest, ours = 0, true
  for i, key in ipairs(KEYS) do
    local h = redis.call('HMGET', key, 'owner', 'expires_ms', 'epoch')
    if h[1] and h[1] ~= owner then
      ours = false
      if tonumber(h[2]) > now and h[1] ~= ARGV[9] then
        local out = {0, i}
        for _, v in ipairs(redis.call('HGETALL', key)) do table.insert(out, v) end
        return out
      end
    elseif not h[1] then
      ours = false
    end
    if h[3] and tonumber(h[3]) > newest then newest = tonumber(h[3]) end
  end
  if ours then
    for _, key in ipairs(KEYS) do
      redis.call('HSET', key, 'expires_ms', now + tonumber(ARGV[3]), 'renewed_ms', now)
    end
    return {1}
  end
  if epoch <= newest then return {-1, newest} end
  for i, key in ipairs(KEYS) do
    redis.call('HSET', key, 'owner', owner, 'epoch', epoch, 'expires_ms', now + tonumber(ARGV[3]),
      'acquired_ms', now, 'renewed_ms', now, 'host', ARGV[6], 'pid', ARGV[7], 'conn', ARGV[8],
      'checkpoint', ARGV[8 + 2 * i], 'ckpt', ARGV[9 + 2 * i])
  end
  return {1}
end

if op == 'renew' then
  for _, key in ipairs(KEYS) do
    if redis.call('HGET', key, 'owner') ~= ARGV[4] then return 0 end
  end
  for _, key in ipairs(KEYS) do
    redis.call('HSET', key, 'expires_ms', now + tonumber(ARGV[3]), 'renewed_ms', now)
  end
  return 1
end

if op == 'release' then
  local n = 0
  for _, key in ipairs(KEYS) do
    if redis.call('HGET', key, 'owner') == ARGV[3] then
      redis.call('HSET', key, 'expires_ms', 0)
      n = n + 1
    end
  end
  return n
end

if op == 'begin' then
  -- Before a leader starts a query: keep terms for this checkpoint. A checkpoint they are not
  -- kept for yet has written the batches it planned so far (up to last_planned) with its own
  -- epoch, as every checkpoint did before leases existed.
  if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[3] then return -1 end
  if redis.call('HGET', KEYS[2], 'ckpt') == ARGV[4] then return 0 end
  local planned, ranges = tonumber(ARGV[6]), {}
  if planned >= 0 then ranges = {{0, tonumber(ARGV[5])}} end
  redis.call('HSET', KEYS[2], 'ckpt', ARGV[4], 'max', planned, 'ranges', cjson.encode(ranges))
  return 1
end

if op == 'epoch' then
  local h = redis.call('HMGET', KEYS[1], 'owner', 'epoch')
  if h[1] ~= ARGV[3] then return -1 end
  local t = redis.call('HMGET', KEYS[2], 'ckpt', 'max', 'ranges')
  if t[1] ~= ARGV[5] then return -2 end
  local mine, batch = tonumber(h[2]), tonumber(ARGV[4])
  local newest, ranges = tonumber(t[2]), cjson.decode(t[3])
  if batch <= newest then
    -- A batch planned before: it writes again with the epoch it was first given.
    local e = tonumber(ARGV[6])
    for _, r in ipairs(ranges) do
      if r[1] <= batch then e = r[2] end
    end
    return e
  end
  if #ranges == 0 or ranges[#ranges][2] ~= mine then
    table.insert(ranges, {batch, mine})
  end
  while #ranges > 64 do table.remove(ranges, 1) end
  redis.call('HSET', KEYS[2], 'max', batch, 'ranges', cjson.encode(ranges))
  return mine
end

return redis.error_reply('lease.lua: unknown operation ' .. tostring(op))
