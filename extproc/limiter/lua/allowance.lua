-- Take allowances: units of a tenant's counters pre-debited for one replica, which then admits
-- and charges from them in process (extproc/limiter/allowance.py).  One call takes for one
-- tenant's counters (every key shares its hash tag: one Cluster slot).  What a replica gives
-- back goes through settle.lua (a refund), not here.
--
-- KEYS[1..n]   fixed-window counters (requests or tokens) of one tenant
-- ARGV         per key, 6 values: units wanted, limit, expire-at (unix ms), the most of the
--              remaining room (limit - value) the replica may hold, in parts per million,
--              the least worth taking (a smaller grant is none: near the limit, allowances
--              shrink to nothing and admission goes to the admission script), and what the
--              replica already holds of this counter (the grant tops it up to the share at
--              most: held + grant <= share x room)
--
-- Returns per key {granted, value after}: the counter includes the grant at once, so other
-- replicas and the usage API see it as used.
local out = {}
for i = 1, #KEYS do
  local a = (i - 1) * 6
  local want = tonumber(ARGV[a + 1])
  local limit = tonumber(ARGV[a + 2])
  local share = tonumber(ARGV[a + 4])
  local least = tonumber(ARGV[a + 5])
  local value = tonumber(redis.call('GET', KEYS[i]) or '0')
  local room = limit - value
  local grant = 0
  if room > 0 then
    grant = math.floor(room * share / 1000000) - tonumber(ARGV[a + 6])
    if grant > want then
      grant = want
    end
    if grant < least or grant < 1 then
      grant = 0
    end
  end
  if grant > 0 then
    value = redis.call('INCRBY', KEYS[i], grant)
    redis.call('PEXPIREAT', KEYS[i], ARGV[a + 3])
  end
  out[i] = {grant, value}
end
return out
