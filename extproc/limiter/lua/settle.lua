-- Settle a request exactly once: apply signed corrections (charge the shortfall, refund the rest).
--
-- KEYS[1]        the request's ledger; state "settled" makes every later call a no-op
-- KEYS[2..n+1]   bucket counters to correct
-- ARGV[1]        ledger TTL in ms (the settled marker is kept this long to catch duplicates)
-- ARGV[2..]      per key, 2 values: signed amount, expire-at (unix ms)
--
-- A refund only touches a counter that still exists (its window has not ended) and never
-- takes it below zero. Returns 1 when applied, 0 when the request was already settled.
if redis.call('HGET', KEYS[1], 'state') == 'settled' then
  return 0
end
local n = #KEYS - 1
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
