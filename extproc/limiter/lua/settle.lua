-- Settle a request exactly once: apply signed corrections (charge the shortfall, refund the rest).
--
-- KEYS[1]        the request's ledger; state "settled" makes every later call a no-op
-- KEYS[2..n+1]   bucket counters to correct
-- KEYS[n+2]      the tenant's open reservations (the ledger leaves it)
-- KEYS[n+3..]    the counters of the request's last, unconfirmed stream charge (see below)
-- ARGV[1]        ledger TTL in ms (the settled marker is kept this long to catch duplicates)
-- ARGV[2]        "1": a cancel (the admission call failed on the caller's side): apply the
--                corrections only if the admission ran after all (state "admitted"); if it
--                has not run yet, mark the ledger "cancelled" so that it never will (a late
--                admit.lua finds the ledger and charges nothing)
-- ARGV[3]        sequence number of a stream charge whose answer never came (0: none): if the
--                ledger shows it ran (seq reached it), what it added is taken back here, since
--                the corrections were computed without it
-- ARGV[4]        n, the number of corrections
-- ARGV[5..]      per correction, 2 values: signed amount, expire-at (unix ms)
-- then           per unconfirmed-charge counter, its rate (units per 1e6 tokens)
--
-- A refund only touches a counter that still exists (its window has not ended) and never
-- takes it below zero.  The request's concurrency slots (the ledger's "c:" fields) are freed,
-- and its usage-record draft is dropped (the settling processor writes the record).
-- Returns 1 when applied, 0 when the request was already settled.
local n = tonumber(ARGV[4])
local open = KEYS[n + 2]
redis.call('ZREM', open, KEYS[1])
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'settled' or state == 'cancelled' then
  return 0
end
local function take(key, amount)
  if amount > 0 and redis.call('EXISTS', key) == 1 then
    if redis.call('DECRBY', key, amount) < 0 then
      redis.call('SET', key, 0, 'KEEPTTL')
    end
  end
end
redis.call('HDEL', KEYS[1], 'rec')
local held = redis.call('HGETALL', KEYS[1])
for j = 1, #held, 2 do
  if string.sub(held[j], 1, 2) == 'c:' then
    redis.call('ZREM', string.sub(held[j], 3), KEYS[1])
  end
end
if ARGV[2] == '1' and state ~= 'admitted' and state ~= 'reclaimed' then
  redis.call('HSET', KEYS[1], 'state', 'cancelled')
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  return 1
end
if state == 'reclaimed' then
  -- Reclaimed as abandoned, but its processor was alive (a lease renewal was lost): put the
  -- refunded reservation back, then apply the corrections as computed.
  for j = 1, #held, 2 do
    local key = string.sub(held[j], 3)
    if string.sub(held[j], 1, 2) == 'r:' and redis.call('EXISTS', key) == 1 then
      redis.call('INCRBY', key, tonumber(held[j + 1]))
    end
  end
end
local useq = tonumber(ARGV[3])
if useq > 0 and tonumber(redis.call('HGET', KEYS[1], 'seq') or '0') >= useq then
  local grant = tonumber(redis.call('HGET', KEYS[1], 'last_grant') or '0')
  for i = n + 3, #KEYS do
    local rate = tonumber(ARGV[4 + 2 * n + (i - n - 2)])
    local units = grant * rate
    local q = math.floor(units / 1000000)
    if q * 1000000 < units then
      q = q + 1
    end
    take(KEYS[i], q)
  end
end
for i = 1, n do
  local amount = tonumber(ARGV[5 + (i - 1) * 2])
  local key = KEYS[i + 1]
  if amount > 0 then
    redis.call('INCRBY', key, amount)
    redis.call('PEXPIREAT', key, ARGV[6 + (i - 1) * 2])
  elseif amount < 0 then
    take(key, -amount)
  end
end
redis.call('HSET', KEYS[1], 'state', 'settled')
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
