-- RLS ShouldRateLimit: every counter of one request checked, then counted all or nothing.
--
-- KEYS[1..n]   fixed-window counters (strings), one per descriptor that has a limit; the same
--              key may appear twice (a descriptor repeated in a request), and then the second
--              sees the first's hits
-- ARGV         per key, 4 values: hits to add (0: check only), limit, expire-at (unix ms),
--              mode: "0" shadow (counted, never refuses), "1" enforced, "2" quota mode (the
--              request is refused only when every quota-mode counter is over)
--
-- A counter is over when its value plus its hits exceeds its limit.  The request is refused
-- when an enforced counter is over, or every quota-mode counter is; then nothing is added.
-- Otherwise each counter gets its hits (a counter is created with its expiry: the end of its
-- window plus a little slack).
--
-- Returns {admitted (1/0), {value of each counter before this request's hits, in order}}.
local n = #KEYS
local running = {}
local before = {}
local refused = false
local quota_total, quota_over = 0, 0
for i = 1, n do
  local key = KEYS[i]
  local base = (i - 1) * 4
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
for i = 1, n do
  local base = (i - 1) * 4
  local hits = tonumber(ARGV[base + 1])
  if hits > 0 then
    local key = KEYS[i]
    if redis.call('INCRBY', key, hits) == hits then
      redis.call('PEXPIREAT', key, ARGV[base + 3])
    end
  end
end
return {1, before}
