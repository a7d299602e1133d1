-- Settlement, shared by settle.lua and admit.lua (the limiter puts this text in front of
-- each; every script is still registered once).  Each request is settled exactly once: state
-- "settled" (or "cancelled") in its ledger makes any later settlement a no-op.
-- A settlement may come before the request's admission or some of its stream charges (a
-- journal replay on a new master after a failover): those still apply, once each (admit.lua,
-- charge.lua), and the counters end where they would have in order: its corrections are
-- signed amounts (a refund is clamped at zero, a counter whose window ended is not touched).
--
-- A request's KEYS and ARGV slices, as settle_all reads them:
--   KEYS: the ledger (hash; state "settled" makes every later settlement a no-op), the
--         tenant's open reservations (the ledger leaves it), n bucket counters to correct,
--         then u counters of the request's last, unconfirmed stream charge (see below)
--   ARGV: ledger TTL in ms (the settled marker is kept this long to catch duplicates),
--         cancel ("1": the admission call failed on the caller's side: apply the corrections
--         only if the admission ran after all (state "admitted"); if it has not run yet, mark
--         the ledger "cancelled" so that it never will (a late admit.lua finds the ledger and
--         charges nothing)),
--         the sequence number of a stream charge whose answer never came (0: none; if the
--         ledger shows it ran (seq reached it), what it added is taken back here, since the
--         corrections were computed without it),
--         n, u,
--         n x (signed amount, expire-at unix ms), u x rate (units per 1e6 tokens)
--
-- A refund only touches a counter that still exists (its window has not ended) and never
-- takes it below zero.  The request's concurrency slots (the ledger's "c:" fields) are freed,
-- and its usage-record draft is dropped (the settling processor writes the record).

-- Take ``amount`` from a counter that still exists, never below zero; what was taken.
local function take(key, amount)
  if amount > 0 and redis.call('EXISTS', key) == 1 then
    local left = redis.call('DECRBY', key, amount)
    if left < 0 then
      redis.call('SET', key, 0, 'KEEPTTL')
      return amount + left
    end
    return amount
  end
  return 0
end

-- k: index of the request's ledger in KEYS; a: index of its TTL in ARGV
local function settle(k, a, n, u)
  local ledger = KEYS[k]
  local ttl = ARGV[a]
  redis.call('ZREM', KEYS[k + 1], ledger)
  local state = redis.call('HGET', ledger, 'state')
  if state == 'settled' or state == 'cancelled' then
    return 0
  end
  redis.call('HDEL', ledger, 'rec')
  local held = redis.call('HGETALL', ledger)
  for j = 1, #held, 2 do
    if string.sub(held[j], 1, 2) == 'c:' then
      redis.call('ZREM', string.sub(held[j], 3), ledger)
    end
  end
  if ARGV[a + 1] == '1' and state ~= 'admitted' and state ~= 'reclaimed' then
    redis.call('HSET', ledger, 'state', 'cancelled')
    redis.call('PEXPIRE', ledger, ttl)
    return 1
  end
  if state == 'reclaimed' then
    -- Reclaimed as abandoned, but its processor was alive (a lease renewal was lost): put
    -- the refunded reservation back, then apply the corrections as computed.
    for j = 1, #held, 2 do
      local key = string.sub(held[j], 3)
      if string.sub(held[j], 1, 2) == 'r:' and redis.call('EXISTS', key) == 1 then
        redis.call('INCRBY', key, tonumber(held[j + 1]))
      end
    end
  end
  local useq = tonumber(ARGV[a + 2])
  if useq > 0 and tonumber(redis.call('HGET', ledger, 'seq') or '0') >= useq
      and redis.call('HEXISTS', ledger, 'g:' .. useq) == 0 then
    local grant = tonumber(redis.call('HGET', ledger, 'last_grant') or '0')
    for i = 1, u do
      local units = grant * tonumber(ARGV[a + 4 + 2 * n + i])
      local q = math.floor(units / 1000000)
      if q * 1000000 < units then
        q = q + 1
      end
      take(KEYS[k + 1 + n + i], q)
    end
  end
  -- before the admission (a replay on a new master): a refund the counter cannot take yet
  -- is owed ("o:<key>"), and taken from what the admission or a replayed charge adds later
  local early = state ~= 'admitted' and state ~= 'reclaimed'
    and redis.call('HEXISTS', ledger, 'adm') == 0
  for i = 1, n do
    local amount = tonumber(ARGV[a + 3 + 2 * i])
    local key = KEYS[k + 1 + i]
    if amount > 0 then
      redis.call('INCRBY', key, amount)
      redis.call('PEXPIREAT', key, ARGV[a + 4 + 2 * i])
    elseif amount < 0 then
      local got = take(key, -amount)
      if early and got < -amount then
        redis.call('HINCRBY', ledger, 'o:' .. key, -amount - got)
      end
    end
  end
  -- "su": a stream charge below this number (any, when 0) that arrives later was counted by
  -- these corrections and still applies (charge.lua); the unconfirmed one never does
  redis.call('HSET', ledger, 'state', 'settled', 'su', useq)
  redis.call('PEXPIRE', ledger, ttl)
  return 1
end

-- Settle m requests: m is ARGV[a], their slices start at KEYS[k] and ARGV[a + 1].  Returns
-- one value per request (1 applied, 0 already settled) and the next unused KEYS and ARGV
-- indexes.
local function settle_all(k, a)
  local out = {}
  local m = tonumber(ARGV[a])
  a = a + 1
  for r = 1, m do
    local n = tonumber(ARGV[a + 3])
    local u = tonumber(ARGV[a + 4])
    out[r] = settle(k, a, n, u)
    k = k + 2 + n + u
    a = a + 5 + 2 * n + u
  end
  return out, k, a
end
