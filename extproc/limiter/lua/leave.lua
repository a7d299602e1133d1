-- A waiting request leaves its tenant's queue (its client hung up, or its replica gave up on
-- it): its ticket goes at once, so nobody behind it waits for it (docs/semantics.md "Waiting").
--
-- KEYS[1..3]     the tenant's queue (tickets), the tickets' leases, their tokens (one hash tag)
-- ARGV[1]        the ticket (the request's ledger)
--
-- Idempotent: a ticket already gone (admitted, refused, lapsed) is left as it is.
-- Returns 1 when a ticket was removed, else 0.
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return removed
