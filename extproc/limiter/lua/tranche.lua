-- Open allowance tranches (extproc/limiter/allowance/tranches.py): the units a replica took
-- (allowance.lua) and has not opened are recorded in its allowance ledger ("r:<counter>"),
-- which a reclaim gives back if the replica dies.  Opening takes units off that record; the
-- replica draws from them only once this call said so.  A record therefore never holds more
-- than the replica still has unopened (a lost answer or a repeat only lowers it), so a
-- reclaim never refunds units a request used: strict mode stays exact.  Never-opened units
-- are given back by opening them first, then refunding them as any others (settle.lua).
--
-- KEYS[1]        this call's id (a string in the ledger's slot): once the call has run, the
--                id holds its answer for ARGV[1] ms and a call with the same id (a retry, a
--                replay to a new master) changes nothing
-- KEYS[2]        the replica's allowance ledger for this tenant
-- KEYS[3..n+2]   the counters
-- ARGV[1]        how long the call id is kept, in ms
-- ARGV[2]        the ledger's generation the replica opens from (allowance.lua)
-- ARGV[3..]      per counter, the units to open
--
-- Returns 1 when the ledger is still held (the tranches are open), 0 when it is not
-- (reclaimed after its lease ran out, lost, or created anew since): nothing is opened (the reclaim refunded the
-- record already), and the replica must neither draw from nor give back what it had not
-- opened.
local id = KEYS[1]
local seen = redis.call('GET', id)
if seen then
  return tonumber(seen)
end
local L = KEYS[2]
local ok = 0
if redis.call('HGET', L, 'state') == 'admitted' and redis.call('HGET', L, 'gen') == ARGV[2] then
  ok = 1
  for i = 1, #KEYS - 2 do
    local key = KEYS[i + 2]
    local field = 'r:' .. key
    local rec = tonumber(redis.call('HGET', L, field) or '0')
    local off = math.min(rec, tonumber(ARGV[i + 2]))
    if off > 0 then
      redis.call('HINCRBY', L, field, -off)
    end
  end
end
redis.call('SET', id, ok, 'PX', ARGV[1])
return ok
