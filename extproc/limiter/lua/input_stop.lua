-- Stop the input shortcut for a model, for every replica (extproc.core.audits): a count found
-- the upstream's input figure outside the bounds the counted path trusts.  The key holds the
-- stops found under one config version (one hash, hash-tagged: one Cluster slot); replicas read
-- its field names.
--
-- KEYS[1]  the stops of this config version (a hash: model -> what the first finder saw)
-- ARGV[1]  the model
-- ARGV[2]  what was found (JSON, kept as written by the first replica to find it)
-- ARGV[3]  how long the key lives (ms), renewed by every stop
--
-- Idempotent (a replay or a second finder changes nothing but the expiry).
-- Returns 1 when this call stopped the model, 0 when it was stopped already.
local set = redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return set
