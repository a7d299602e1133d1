-- Charge output tokens of a running stream (lazy batch or strict lease), idempotent by sequence.
--
-- KEYS[1]        the request's ledger
-- KEYS[2..n+1]   per-token counters of the current windows (tokens, money, weighted tokens)
-- KEYS[n+2..]    previous windows' counters of sliding limits (referenced by index below)
-- ARGV[1]        sequence number of this charge (1, 2, ...); a replayed number charges nothing
-- ARGV[2]        output tokens asked for
-- ARGV[3]        "1" strict: grant at most what every bucket still has; "0" lazy: charge all
-- ARGV[4]        ledger TTL in ms
-- ARGV[5..]      per bucket, 6 values: limit, expire-at (unix ms), rate (units per 1e6
--                tokens: a bucket gets ceil(granted * rate / 1e6)), shadow ("1": counted,
--                never limits the grant nor ends the stream), the KEYS index of the previous
--                window's counter (0: not sliding) and its weight in parts per million
--
-- Returns {granted, over, {value per bucket}}: over is 1 when a bucket is at or past its limit
-- after this charge (lazy: the caller cuts the stream; strict: not one more token fits).
local W = 6
local n = (#ARGV - 4) / W
local SCALE = 1000000
-- ceil(a / b) for integers a >= 0, b > 0, exact while a < 2^53 (a float quotient near an
-- integer is corrected with exact products)
local function ceil_div(a, b)
  local q = math.floor(a / b)
  if q * b < a then
    q = q + 1
  elseif (q - 1) * b >= a then
    q = q - 1
  end
  return q
end
local function floor_div(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end
local seq = tonumber(ARGV[1])
local asked = tonumber(ARGV[2])
local strict = ARGV[3] == '1'
local vals = {}
local prev = {}
for i = 1, n do
  local base = 5 + (i - 1) * W
  prev[i] = 0
  local p = tonumber(ARGV[base + 4])
  if p > 0 then
    local before = tonumber(redis.call('GET', KEYS[p]) or '0')
    prev[i] = math.floor(before * tonumber(ARGV[base + 5]) / 1000000)
  end
  vals[i] = tonumber(redis.call('GET', KEYS[i + 1]) or '0') + prev[i]
end
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'settled' or state == 'cancelled' then
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
    local base = 5 + (i - 1) * W
    local limit = tonumber(ARGV[base])
    local rate = tonumber(ARGV[base + 2])
    if ARGV[base + 3] ~= '1' and rate > 0 then
      local room = limit - vals[i]
      local fits = 0
      if room > 0 then
        fits = floor_div(room * SCALE, rate)
      end
      if fits < grant then
        grant = fits
      end
    end
  end
  if grant < 0 then
    grant = 0
  end
end
local over = 0
for i = 1, n do
  local base = 5 + (i - 1) * W
  local limit = tonumber(ARGV[base])
  local rate = tonumber(ARGV[base + 2])
  if grant > 0 and rate > 0 then
    vals[i] = redis.call('INCRBY', KEYS[i + 1], ceil_div(grant * rate, SCALE)) + prev[i]
    redis.call('PEXPIREAT', KEYS[i + 1], ARGV[base + 1])
  end
  if ARGV[base + 3] ~= '1' and rate > 0 then
    if (strict and (limit - vals[i]) * SCALE < rate) or ((not strict) and vals[i] > limit) then
      over = 1
    end
  end
end
redis.call('HSET', KEYS[1], 'seq', seq, 'last_grant', grant)
redis.call('HINCRBY', KEYS[1], 'charged', grant)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {grant, over, vals}
