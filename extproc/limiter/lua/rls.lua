-- RLS ShouldRateLimit: every counter of one request checked, then counted all or nothing.
--
-- KEYS[1]      this call's id (a string in the counters' slot): once the call has counted,
--              the id holds its answer for ARGV[1] ms, and a call carrying the same id (a
--              retry whose first attempt ran after all, or a replay to a new master after a
--              failover) returns that answer and counts nothing
-- KEYS[2..n+1] fixed-window counters (strings), one per descriptor that has a limit; the same
--              key may appear twice (a descriptor repeated in a request), and then the second
--              sees the first's hits
-- ARGV[1]      how long the call id is kept, in ms
-- ARGV[2]      "1": every counter is counted as if in shadow mode (never refuses): a replay
--              of a call that was admitted; "0" otherwise
-- ARGV[3..]    per counter, 4 values: hits to add (0: check only), limit, expire-at (unix ms),
--              mode: "0" shadow (counted, never refuses), "1" enforced, "2" quota mode (the
--              request is refused only when every quota-mode counter is over)
--
-- A counter is over when its value plus its hits exceeds its limit.  The request is refused
-- when an enforced counter is over, or every quota-mode counter is; then nothing is added.
-- Otherwise each counter gets its hits (a counter is created with its expiry: the end of its
-- window plus a little slack).
--
-- Returns {admitted (1/0), {value of each counter before this request's hits, in order}}.
local id = KEYS[1]
local seen = redis.call('GET', id)
if seen then
  local before = {}
  for v in string.gmatch(seen, '[^,]+') do
    before[#before + 1] = tonumber(v)
  end
  return {1, before}
end
local force = ARGV[2] == '1'
local n = #KEYS - 1
local running = {}
local before = {}
local refused = false
local quota_total, quota_over = 0, 0
for i = 1, n do
  local key = KEYS[i + 1]
  local base = 2 + (i - 1) * 4
  local hits = tonumber(ARGV[base + 1])
  local limit = tonumber(ARGV[base + 2])
  local mode = ARGV[base + 4]
  local value = running[key]
  if value == nil then
    value = tonumber(redis.call('GET', key) or '0')
  end
  before[i] = value
  running[key] = value + hits
  local over = value + hits > limit
  if force then
    mode = '0'
  end
  if mode == '1' and over then
    refused = true
  elseif mode == '2' then
    quota_total = quota_total + 1
    if over then
      quota_over = quota_over + 1
    end
  end
end
if quota_total > 0 and quota_over == quota_total then
  refused = true
end
if refused then
  return {0, before}
end
local counted = false
for i = 1, n do
  local base = 2 + (i - 1) * 4
  local hits = tonumber(ARGV[base + 1])
  if hits > 0 then
    counted = true
    local key = KEYS[i + 1]
    if redis.call('INCRBY', key, hits) == hits then
      redis.call('PEXPIREAT', key, ARGV[base + 3])
    end
  end
end
if counted then
  redis.call('SET', id, table.concat(before, ','), 'PX', ARGV[1])
end
return {1, before}
