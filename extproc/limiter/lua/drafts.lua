-- Keep the usage-record drafts of requests a replica admitted from its allowances
-- (allowance/drafts.py), batched: one call a flush interval for all of one tenant's, so that a
-- SIGKILLed replica's open requests still get their records (the reclaim of its draft ledger
-- hands them back: drafts_lib.lua).  A request that settles before its draft was sent never
-- costs a call; one that settles after has its draft dropped by a later call.
--
-- KEYS[1]        the replica's draft ledger for the tenant (hash: state "admitted", "drf" 1,
--                "d:<request ledger>" draft, "k:<request ledger>" tokens charged)
-- KEYS[2]        the tenant's open reservations (sorted set: ledger -> lease deadline, ms)
-- KEYS[3..]      ledgers of requests Redis admitted whose stream charges the replica drew from
--                its allowances: those tokens are added to their "charged" (what a reclaim
--                bills) while they are open (state "admitted")
-- ARGV[1]        the lease deadline (unix ms): the ledger is reclaimed once it has passed
-- ARGV[2]        the ledger's TTL (ms)
-- ARGV[3..5]     a, c, d: drafts to keep, charged figures to update, drafts to drop
-- then           a x (request ledger, charged, draft), c x (request ledger, charged),
--                d x request ledger, then per KEYS[3..] the tokens to add
--
-- Every call renews the lease.  Returns 1, or 0 when the ledger was not held (never written,
-- expired, or reclaimed because renewals were lost): it is created anew with this call's
-- drafts, and the replica must send again every draft it had sent before.
local L = KEYS[1]
local held = 1
if redis.call('HGET', L, 'state') ~= 'admitted' then
  held = 0
  redis.call('DEL', L)
  redis.call('HSET', L, 'state', 'admitted', 'drf', 1)
end
local a = tonumber(ARGV[3])
local c = tonumber(ARGV[4])
local d = tonumber(ARGV[5])
local i = 6
for _ = 1, a do
  redis.call('HSET', L, 'd:' .. ARGV[i], ARGV[i + 2], 'k:' .. ARGV[i], ARGV[i + 1])
  i = i + 3
end
for _ = 1, c do
  redis.call('HSET', L, 'k:' .. ARGV[i], ARGV[i + 1])
  i = i + 2
end
for _ = 1, d do
  redis.call('HDEL', L, 'd:' .. ARGV[i], 'k:' .. ARGV[i])
  i = i + 1
end
for k = 3, #KEYS do
  if redis.call('HGET', KEYS[k], 'state') == 'admitted' then
    redis.call('HINCRBY', KEYS[k], 'charged', ARGV[i])
  end
  i = i + 1
end
redis.call('PEXPIRE', L, ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[1], L)
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
return held
