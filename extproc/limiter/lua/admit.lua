-- Atomic, all-or-nothing admission over every bucket of one request.
--
-- KEYS[1]        the request's ledger (hash); its existence makes a replayed request id a no-op
-- KEYS[2..n+1]   bucket counters (one fixed window each), all sharing one hash tag
-- ARGV[1]        ledger TTL in ms
-- ARGV[2]        "1" to count a refused request in its RPM buckets anyway, else "0"
-- ARGV[3]        TPM tokens this admission charges (recorded in the ledger)
-- ARGV[4..]      per bucket, 4 values: kind ("r" or "t"), amount, limit, expire-at (unix ms)
--
-- Returns {status, {value per bucket}}: status 1 admitted (values after charging),
-- 0 refused (values as found), 2 duplicate request id (nothing charged; values as found).
local n = #KEYS - 1
local vals = {}
for i = 1, n do
  vals[i] = tonumber(redis.call('GET', KEYS[i + 1]) or '0')
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {2, vals}
end
local ok = true
for i = 1, n do
  local base = 4 + (i - 1) * 4
  local amount = tonumber(ARGV[base + 1])
  local limit = tonumber(ARGV[base + 2])
  if amount > 0 and vals[i] + amount > limit then
    ok = false
  end
end
if ok then
  for i = 1, n do
    local base = 4 + (i - 1) * 4
    local amount = tonumber(ARGV[base + 1])
    if amount > 0 then
      vals[i] = redis.call('INCRBY', KEYS[i + 1], amount)
      redis.call('PEXPIREAT', KEYS[i + 1], ARGV[base + 3])
    end
  end
  redis.call('HSET', KEYS[1], 'state', 'admitted', 'seq', 0, 'charged', ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  return {1, vals}
end
if ARGV[2] == '1' then
  for i = 1, n do
    local base = 4 + (i - 1) * 4
    if ARGV[base] == 'r' then
      vals[i] = redis.call('INCRBY', KEYS[i + 1], 1)
      redis.call('PEXPIREAT', KEYS[i + 1], ARGV[base + 3])
    end
  end
end
return {0, vals}
