-- Write what a request's exact input count found into its open ledger, so that a reclaim (its
-- processor died) refunds the rest of the upper bound its admission charged.  One call notes
-- one request or a batch of them (every key of a batch in one Cluster slot).
--
-- ARGV[1]        m, the number of notes in this call
-- then per note, in order:
--   KEYS: the request's ledger
--   ARGV: the exact input tokens, n, then n x (counter key, units): what admission charged
--         that counter beyond the exact input (added to the units a reclaim refunds)
--
-- Only a ledger still open ("admitted") and not noted before takes a note: a settled,
-- cancelled, reclaimed or expired one is left as it is (nothing is created).
--
-- Returns one value per note: 1 written, 0 left as it was.
local out = {}
local a = 2
for r = 1, tonumber(ARGV[1]) do
  local ledger = KEYS[r]
  local n = tonumber(ARGV[a + 1])
  if redis.call('HGET', ledger, 'state') == 'admitted' and redis.call('HEXISTS', ledger, 'in') == 0 then
    redis.call('HSET', ledger, 'in', ARGV[a])
    for i = 1, n do
      local units = tonumber(ARGV[a + 1 + 2 * i])
      if units > 0 then
        redis.call('HINCRBY', ledger, 'r:' .. ARGV[a + 2 * i], units)
      end
    end
    out[r] = 1
  else
    out[r] = 0
  end
  a = a + 2 + 2 * n
end
return out
