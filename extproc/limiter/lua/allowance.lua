-- Take allowances: units of a tenant's counters pre-debited for one replica, which then admits
-- and charges from them in process (extproc/limiter/allowance/).  One call takes for one
-- tenant's counters (every key shares its hash tag: one Cluster slot).  What a replica gives
-- back goes through settle.lua (a refund) or tranche.lua, not here.
--
-- KEYS[1]        this call's id (a string in the counters' slot): once the call has run, the
--                id holds its grants for ARGV[1] ms, and a call carrying the same id (a retry
--                whose first attempt ran after all, or a replay to a new master after a
--                failover) grants nothing more and answers the same grants
-- KEYS[2..n+1]   fixed-window counters (requests or tokens) of one tenant
-- KEYS[n+2]      (leased takes) the replica's allowance ledger for this tenant (a hash, like a
--                request's ledger: state "admitted", "alw" 1, and per counter "r:<counter>",
--                the units granted and not yet opened by the replica)
-- KEYS[n+3]      (leased takes) the tenant's open reservations (sorted set: ledger -> lease
--                deadline, ms), where the allowance ledger is leased like a request's
-- ARGV[1]        how long the call id is kept, in ms
-- ARGV[2]        "1": a replay of a take that was answered: each counter gets exactly the units
--                wanted (the grant it had), whatever its room; "0" otherwise
-- ARGV[3..]      per counter, 7 values: units wanted, limit, expire-at (unix ms), the most of
--                the remaining room (limit - value) the replica may hold, in parts per
--                million, the least worth taking (a smaller grant is none: near the limit,
--                allowances shrink to nothing and admission goes to the admission script), and
--                what the replica already holds of this counter (the grant tops it up to the
--                share at most: held + grant <= share x room), and (leased takes) how much of
--                what it holds is open (see below)
-- then           (leased takes) now (unix ms), the lease deadline (unix ms), the number of
--                tranches a grant is split into, and the allowance ledger's TTL (ms)
--
-- Tranches (leased takes): what the replica holds after a grant (held + grant) is split into
-- tranches of ceil((held + grant) / tranches) units, at least the least worth taking (its
-- largest request), that the replica opens one by one (tranche.lua) as it draws; at the take,
-- what brings its open units up to one and a half tranches is open at once (the most a
-- tranche opening leaves open: a take made when an opening was due opens it, one call), and
-- the rest of the grant is recorded as "r:" in the allowance ledger until the replica opens it.  If the lease runs out (the
-- replica died), the next admission (admit.lua) or take (here) of the tenant reclaims the
-- ledger like a request's: the never-opened units go back to their counters.
--
-- Before taking, up to 8 allowance or draft ledgers of this tenant whose lease ran out are
-- reclaimed (request ledgers are left to admit.lua, which hands back their usage-record
-- drafts); a draft ledger's drafts are handed back (drafts_lib.lua, which the limiter puts in
-- front of this text), so that the caller writes the dead replica's requests' records.
--
-- Returns {per counter {granted, value after}, units reclaimed, the ledger's generation,
-- {request ledger, draft, charged, -1, ...} of the drafts reclaimed}: the
-- counter includes the grant at once, so other replicas and the usage API see it as used.  A
-- ledger created by a take gets that call's id as its generation; a replica whose ledger
-- changed generation knows that what it recorded in the old one was reclaimed (or lost), and
-- never opens it (tranche.lua checks the generation).
local id = KEYS[1]
local W = 7
local n = math.floor((#ARGV - 2) / W)
local leased = #ARGV - 2 - W * n == 4
local seen = redis.call('GET', id)
if seen then
  local out = {}
  local i = 0
  for v in string.gmatch(seen, '[^,]+') do
    i = i + 1
    out[i] = {tonumber(v), tonumber(redis.call('GET', KEYS[i + 1]) or '0')}
  end
  local gen = ''
  if leased then
    gen = redis.call('HGET', KEYS[n + 2], 'gen') or ''
  end
  return {out, 0, gen, {}}
end
local reclaimed = 0
local drafts = {}
local gen = ''
local L, open, tranches
if leased then
  L = KEYS[n + 2]
  open = KEYS[n + 3]
  local t = 3 + W * n
  local now = tonumber(ARGV[t])
  local dead = redis.call('ZRANGEBYSCORE', open, '-inf', now, 'LIMIT', 0, 16)
  local done = 0
  for _, led in ipairs(dead) do
    local drf = redis.call('HGET', led, 'drf') == '1'
    if done < 8 and (drf or redis.call('HGET', led, 'alw') == '1') then
      done = done + 1
      redis.call('ZREM', open, led)
      if drf then
        if redis.call('HGET', led, 'state') == 'admitted' then
          reclaim_drafts(led, redis.call('HGETALL', led), drafts)
          redis.call('HSET', led, 'state', 'reclaimed')
        end
      elseif redis.call('HGET', led, 'state') == 'admitted' then
        local fields = redis.call('HGETALL', led)
        for j = 1, #fields, 2 do
          if string.sub(fields[j], 1, 2) == 'r:' then
            local key = string.sub(fields[j], 3)
            local units = tonumber(fields[j + 1])
            if units > 0 and redis.call('EXISTS', key) == 1 then
              reclaimed = reclaimed + units
              if redis.call('DECRBY', key, units) < 0 then
                redis.call('SET', key, 0, 'KEEPTTL')
              end
            end
          end
        end
        redis.call('HSET', led, 'state', 'reclaimed')
      end
    end
  end
  tranches = tonumber(ARGV[t + 2])
  if redis.call('HGET', L, 'state') ~= 'admitted' then
    redis.call('DEL', L)
    redis.call('HSET', L, 'state', 'admitted', 'alw', 1, 'gen', id)
  end
  gen = redis.call('HGET', L, 'gen')
  redis.call('PEXPIRE', L, ARGV[t + 3])
  redis.call('ZADD', open, ARGV[t + 1], L)
  local pttl = redis.call('PTTL', open)
  if pttl < tonumber(ARGV[t + 3]) then
    redis.call('PEXPIRE', open, ARGV[t + 3])
  end
end
local replay = ARGV[2] == '1'
local out = {}
local grants = {}
for i = 1, n do
  local a = 2 + (i - 1) * W
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
    if leased then
      local tranche = math.max(math.ceil((tonumber(ARGV[a + 6]) + grant) / tranches), least)
      local now_open = tranche + math.floor(tranche / 2) - tonumber(ARGV[a + 7])
      local closed = grant - math.max(0, math.min(grant, now_open))
      if closed > 0 then
        redis.call('HINCRBY', L, 'r:' .. key, closed)
      end
    end
  end
  out[i] = {grant, value}
  grants[i] = grant
end
redis.call('SET', id, table.concat(grants, ','), 'PX', ARGV[1])
return {out, reclaimed, gen, drafts}
