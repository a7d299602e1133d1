-- Take allowances: units of a tenant's counters pre-debited for one replica, which then admits
-- and charges from them in process (extproc/limiter/allowance.py).  One call takes for one
-- tenant's counters (every key shares its hash tag: one Cluster slot).  What a replica gives
-- back goes through settle.lua (a refund), not here.
--
-- KEYS[1]        this call's id (a string in the counters' slot): once the call has run, the
--                id holds its grants for ARGV[1] ms, and a call carrying the same id (a retry
--                whose first attempt ran after all, or a replay to a new master after a
--                failover) grants nothing more and answers the same grants
-- KEYS[2..n+1]   fixed-window counters (requests or tokens) of one tenant
-- ARGV[1]        how long the call id is kept, in ms
-- ARGV[2]        "1": a replay of a take that was answered: each counter gets exactly the units
--                wanted (the grant it had), whatever its room; "0" otherwise
-- ARGV[3..]      per counter, 6 values: units wanted, limit, expire-at (unix ms), the most of
--                the remaining room (limit - value) the replica may hold, in parts per
--                million, the least worth taking (a smaller grant is none: near the limit,
--                allowances shrink to nothing and admission goes to the admission script), and
--                what the replica already holds of this counter (the grant tops it up to the
--                share at most: held + grant <= share x room)
--
-- Returns per counter {granted, value after}: the counter includes the grant at once, so other
-- replicas and the usage API see it as used.
local id = KEYS[1]
local seen = redis.call('GET', id)
if seen then
  local out = {}
  local i = 0
  for v in string.gmatch(seen, '[^,]+') do
    i = i + 1
    out[i] = {tonumber(v), tonumber(redis.call('GET', KEYS[i + 1]) or '0')}
  end
  return out
end
local replay = ARGV[2] == '1'
local out = {}
local grants = {}
for i = 1, #KEYS - 1 do
  local a = 2 + (i - 1) * 6
  local key = KEYS[i + 1]
  local want = tonumber(ARGV[a + 1])
  local limit = tonumber(ARGV[a + 2])
  local share = tonumber(ARGV[a + 4])
  local least = tonumber(ARGV[a + 5])
  local value = tonumber(redis.call('GET', key) or '0')
  local room = limit - value
  local grant = 0
  if replay then
    grant = want
  elseif room > 0 then
    grant = math.floor(room * share / 1000000) - tonumber(ARGV[a + 6])
    if grant > want then
      grant = want
    end
    if grant < least or grant < 1 then
      grant = 0
    end
  end
  if grant > 0 then
    value = redis.call('INCRBY', key, grant)
    redis.call('PEXPIREAT', key, ARGV[a + 3])
  end
  out[i] = {grant, value}
  grants[i] = grant
end
redis.call('SET', id, table.concat(grants, ','), 'PX', ARGV[1])
return out
