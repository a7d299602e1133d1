-- Usage-record drafts of requests a replica admitted from allowances (allowance/drafts.py), kept
-- in the replica's draft ledger for the tenant (drafts.lua): a hash with state "admitted",
-- "drf" 1, and per open request "d:<its ledger>" (the draft) and "k:<its ledger>" (the tokens
-- it had charged when last sent), leased in the tenant's open reservations.  The limiter puts
-- this text in front of admit.lua and allowance.lua, whose reclaims hand the drafts back.

-- Hand back the drafts of a dead replica's draft ledger ``led`` (its HGETALL ``fields``),
-- once: each is removed as it is appended to ``out`` as (request ledger, draft, charged, -1),
-- the shape admit.lua hands back a reclaimed request's draft in.
local function reclaim_drafts(led, fields, out)
  local charged = {}
  for j = 1, #fields, 2 do
    if string.sub(fields[j], 1, 2) == 'k:' then
      charged[string.sub(fields[j], 3)] = fields[j + 1]
    end
  end
  for j = 1, #fields, 2 do
    if string.sub(fields[j], 1, 2) == 'd:' then
      local req = string.sub(fields[j], 3)
      out[#out + 1] = req
      out[#out + 1] = fields[j + 1]
      out[#out + 1] = charged[req] or '0'
      out[#out + 1] = '-1'
      redis.call('HDEL', led, fields[j], 'k:' .. req)
    end
  end
end
