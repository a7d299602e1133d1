-- Charge output tokens of running streams (lazy batch or strict lease), idempotent by sequence.
-- One call charges one stream or a batch of them (every key of a batch in one Cluster slot);
-- each charge is judged on its own ledger and sequence number, in order.
--
-- ARGV[1]        m, the number of charges in this call
-- then per charge, in order, its KEYS and ARGV slices:
--   KEYS: the request's ledger, n per-token counters of the current windows (tokens, money,
--         weighted tokens), then p previous windows' counters of sliding limits
--   ARGV: sequence number of this charge (1, 2, ...; a number applied before charges
--         nothing: the ledger keeps the highest one applied ("seq") and, below it, the
--         numbers skipped ("g:<n>" fields), which a charge arriving late may still take: a
--         journal replay on a new master that got later charges of the stream first),
--         output tokens asked for,
--         "1" strict: grant at most what every bucket still has; "0" lazy: charge all;
--         "r" a journal replay of an acknowledged charge (lazy, see "settled" below),
--         ledger TTL in ms, n, p,
--         per bucket, 6 values: limit, expire-at (unix ms), rate (units per 1e6 tokens: a
--         bucket gets ceil(granted * rate / 1e6)), shadow ("1": counted, never limits the
--         grant nor ends the stream), the KEYS index (absolute, in this call) of the previous
--         window's counter (0: not sliding) and its weight in parts per million
--
-- Returns per charge {granted, over, {value per bucket}}: over is 1 when a bucket is at or
-- past its limit after this charge (lazy: the caller cuts the stream; strict: not one more
-- token fits).
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

-- k: index of the charge's ledger in KEYS; a: index of its sequence number in ARGV
local function charge(k, a, n)
  local ledger = KEYS[k]
  local seq = tonumber(ARGV[a])
  local asked = tonumber(ARGV[a + 1])
  local strict = ARGV[a + 2] == '1'
  local vals = {}
  local prev = {}
  for i = 1, n do
    local base = a + 6 + (i - 1) * 6
    prev[i] = 0
    local p = tonumber(ARGV[base + 4])
    if p > 0 then
      local before = tonumber(redis.call('GET', KEYS[p]) or '0')
      prev[i] = math.floor(before * tonumber(ARGV[base + 5]) / 1000000)
    end
    vals[i] = tonumber(redis.call('GET', KEYS[k + i]) or '0') + prev[i]
  end
  local state = redis.call('HGET', ledger, 'state')
  if state == 'cancelled' then
    return {0, 0, vals}
  end
  local last = tonumber(redis.call('HGET', ledger, 'seq') or '0')
  -- a number below the highest one applied is new only if it was skipped (a gap)
  local gap = seq < last and redis.call('HEXISTS', ledger, 'g:' .. seq) == 1
  if seq <= last and not gap then
    local g = 0
    if seq == last then
      g = tonumber(redis.call('HGET', ledger, 'last_grant') or '0')
    end
    return {g, 0, vals}
  end
  if state == 'settled' then
    -- Only a journal replay ("r") of a charge the settlement counted (acknowledged before it:
    -- below its unconfirmed number "su", or any when it had none) still applies: a new
    -- master got the settlement first.  A settlement of an older script has no "su".
    local su = tonumber(redis.call('HGET', ledger, 'su') or '-1')
    if ARGV[a + 2] ~= 'r' or su < 0 or (su > 0 and seq >= su) then
      return {0, 0, vals}
    end
  end
  local grant = asked
  if strict then
    for i = 1, n do
      local base = a + 6 + (i - 1) * 6
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
    local base = a + 6 + (i - 1) * 6
    local limit = tonumber(ARGV[base])
    local rate = tonumber(ARGV[base + 2])
    if grant > 0 and rate > 0 then
      local units = ceil_div(grant * rate, SCALE)
      if state == 'settled' then -- a refund the settlement owes this counter (settle_lib.lua)
        local owed = tonumber(redis.call('HGET', ledger, 'o:' .. KEYS[k + i]) or '0')
        local d = math.min(owed, units)
        if d > 0 then
          redis.call('HINCRBY', ledger, 'o:' .. KEYS[k + i], -d)
          units = units - d
        end
      end
      vals[i] = redis.call('INCRBY', KEYS[k + i], units) + prev[i]
      redis.call('PEXPIREAT', KEYS[k + i], ARGV[base + 1])
    end
    if ARGV[base + 3] ~= '1' and rate > 0 then
      if (strict and (limit - vals[i]) * SCALE < rate) or ((not strict) and vals[i] > limit) then
        over = 1
      end
    end
  end
  if gap then
    redis.call('HDEL', ledger, 'g:' .. seq)
  else
    for j = last + 1, seq - 1 do -- skipped numbers: their charges may still come (replays)
      redis.call('HSET', ledger, 'g:' .. j, 1)
    end
    redis.call('HSET', ledger, 'seq', seq, 'last_grant', grant)
  end
  redis.call('HINCRBY', ledger, 'charged', grant)
  redis.call('PEXPIRE', ledger, ARGV[a + 3])
  return {grant, over, vals}
end

local out = {}
local k = 1
local a = 2
for r = 1, tonumber(ARGV[1]) do
  local n = tonumber(ARGV[a + 4])
  local p = tonumber(ARGV[a + 5])
  out[r] = charge(k, a, n)
  k = k + 1 + n + p
  a = a + 6 + 6 * n
end
return out
