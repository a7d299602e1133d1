-- Settle a request exactly once: apply signed corrections (charge the shortfall, refund the rest).
--
-- KEYS[1]        the request's ledger; state "settled" makes every later call a no-op
-- KEYS[2..n+1]   bucket counters to correct
-- KEYS[n+2]      the tenant's open reservations (the ledger leaves it)
-- ARGV[1]        ledger TTL in ms (the settled marker is kept this long to catch duplicates)
-- ARGV[2..]      per key, 2 values: signed amount, expire-at (unix ms)
--
-- A refund only touches a counter that still exists (its window has not ended) and never
-- takes it below zero.  The request's concurrency slots (the ledger's "c:" fields) are freed.
-- Returns 1 when applied, 0 when the request was already settled.
local n = #KEYS - 2
redis.call('ZREM', KEYS[n + 2], KEYS[1])
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'settled' then
  return 0
end
local held = redis.call('HGETALL', KEYS[1])
for j = 1, #held, 2 do
  if string.sub(held[j], 1, 2) == 'c:' then
    redis.call('ZREM', string.sub(held[j], 3), KEYS[1])
  end
end
if state == 'reclaimed' then
  -- Reclaimed as abandoned, but its processor was alive (a lease renewal was lost): put the
  -- refunded reservation back, then apply the corrections as computed.
  local fields = redis.call('HGETALL', KEYS[1])
  for j = 1, #fields, 2 do
    local key = string.sub(fields[j], 3)
    if string.sub(fields[j], 1, 2) == 'r:' and redis.call('EXISTS', key) == 1 then
      redis.call('INCRBY', key, tonumber(fields[j + 1]))
    end
  end
end
local net = 0
for i = 1, n do
  local amount = tonumber(ARGV[2 + (i - 1) * 2])
  local key = KEYS[i + 1]
  if amount > 0 then
    redis.call('INCRBY', key, amount)
    redis.call('PEXPIREAT', key, ARGV[3 + (i - 1) * 2])
  elseif amount < 0 and redis.call('EXISTS', key) == 1 then
    local v = redis.call('INCRBY', key, amount)
    if v < 0 then
      redis.call('SET', key, 0, 'KEEPTTL')
    end
  end
end
redis.call('HSET', KEYS[1], 'state', 'settled')
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
