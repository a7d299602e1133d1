-- Settle requests exactly once each: apply signed corrections (charge the shortfall, refund
-- the rest).  One call settles one request or a batch of them (every key of a batch in one
-- Cluster slot); each request is judged on its own ledger, so a batch may repeat a ledger or
-- hold one settled before (both are no-ops).  The settlement itself is settle_lib.lua's,
-- which the limiter puts in front of this text.
--
-- ARGV[1]        m, the number of requests in this call
-- then per request, in order, its KEYS and ARGV slices (settle_lib.lua)
--
-- Returns one value per request: 1 when applied, 0 when it was already settled.
local out = settle_all(1, 1)
return out
