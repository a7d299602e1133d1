-- Charge output tokens of a running stream (lazy batch or strict lease), idempotent by sequence.
--
-- KEYS[1]        the request's ledger
-- KEYS[2..n+1]   TPM bucket counters of the current windows
-- ARGV[1]        sequence number of this charge (1, 2, ...); a replayed number charges nothing
-- ARGV[2]        tokens asked for
-- ARGV[3]        "1" strict: grant at most what every bucket still has; "0" lazy: charge all
-- ARGV[4]        ledger TTL in ms
-- ARGV[5..]      per bucket, 2 values: limit, expire-at (unix ms)
--
-- Returns {granted, over, {value per bucket}}: over is 1 when a bucket is at or past its limit
-- after this charge (lazy: the caller cuts the stream; strict: nothing more can be leased).
local n = #KEYS - 1
local seq = tonumber(ARGV[1])
local asked = tonumber(ARGV[2])
local strict = ARGV[3] == '1'
local vals = {}
for i = 1, n do
  vals[i] = tonumber(redis.call('GET', KEYS[i + 1]) or '0')
end
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'settled' then
  return {0, 0, vals}
end
local last = tonumber(redis.call('HGET', KEYS[1], 'seq') or '0')
if seq <= last then
  local g = 0
  if seq == last then
    g = tonumber(redis.call('HGET', KEYS[1], 'last_grant') or '0')
  end
  return {g, 0, vals}
end
local grant = asked
if strict then
  for i = 1, n do
    local limit = tonumber(ARGV[5 + (i - 1) * 2])
    local room = limit - vals[i]
    if room < grant then
      grant = room
    end
  end
  if grant < 0 then
    grant = 0
  end
end
local over = 0
for i = 1, n do
  local limit = tonumber(ARGV[5 + (i - 1) * 2])
  if grant > 0 then
    vals[i] = redis.call('INCRBY', KEYS[i + 1], grant)
    redis.call('PEXPIREAT', KEYS[i + 1], ARGV[6 + (i - 1) * 2])
  end
  if (strict and vals[i] >= limit) or ((not strict) and vals[i] > limit) then
    over = 1
  end
end
redis.call('HSET', KEYS[1], 'seq', seq, 'last_grant', grant)
redis.call('HINCRBY', KEYS[1], 'charged', grant)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {grant, over, vals}
