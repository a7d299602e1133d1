-- Atomic, all-or-nothing admission over every bucket of one request, after settling the
-- requests whose settlements ride on it (settle_lib.lua, which the limiter puts in front).
--
-- ARGV[1]        m, settlements riding on this call (0: none), then their KEYS and ARGV
--                slices (settle_lib.lua): they are applied first, so what they refund is
--                room this admission may use.  Below, KEYS[k] means KEYS[K0 + k] and ARGV[a]
--                ARGV[A0 + a], the first indexes after the riders' slices.
-- KEYS[1]        the request's ledger (hash); its "adm" field (or a state "admitted",
--                "reclaimed" or "cancelled") makes a replayed request id a no-op.  A ledger a
--                stream charge or a settlement created first (a journal replay on a new master
--                after a failover: later calls of the request landed there before its lost
--                admission was replayed) takes the admission: its counters are charged once;
--                a settled one opens no reservation nor concurrency slot.
-- KEYS[2..n+1]   bucket counters, all sharing one hash tag: a string counter per window for
--                requests ("r") and per-token units ("t": tokens, money, weighted tokens), a
--                sorted set of leased requests for a concurrency limit ("c"), or a set of a
--                team's end users in the window ("u": its member is the name at the bucket's
--                "previous window" index, never read as a key; a member already in the set
--                adds nothing, a new one is refused once the set holds the limit)
-- KEYS[n+2]      the tenant's open reservations (sorted set: ledger -> lease deadline, ms)
-- KEYS[n+3..]    previous windows' counters of sliding limits (referenced by index below)
-- ARGV[1]        ledger TTL in ms
-- ARGV[2]        "1" to count a refused request in its RPM buckets anyway, else "0"
-- ARGV[3]        TPM tokens this admission charges (recorded in the ledger)
-- ARGV[4..]      per bucket, 8 values: kind ("r", "t" or "c"), amount, limit, expire-at (unix
--                ms), refundable units (given back if the request is reclaimed), shadow ("1":
--                counted, never refuses), the absolute KEYS index (the riders' keys counted)
--                of the previous window's counter (0: not sliding) and its weight in parts
--                per million: a sliding bucket's value is current + floor(previous x weight /
--                1e6)
-- then           now (unix ms), lease deadline (unix ms; 0 = no lease), and the request's
--                usage-record draft ("" for none), kept in the ledger while it is open
-- then           the queue section (waiting, docs/semantics.md "Waiting"; the rule is
--                extproc/core/waiting.py's decide, mirrored here), q values, and last q itself
--                (0: the request does not wait).  Its values: the absolute KEYS index of the
--                tenant's queue (sorted set: ticket -> order score), followed in KEYS by the
--                tickets' leases (sorted set: ticket -> lease deadline) and their TPM tokens
--                (hash, and its field "~last": the last arrival stamp); the ticket's priority
--                offset (ms: it queues as if it had arrived that much earlier; its arrival is
--                stamped by Redis's TIME, in microseconds), the request's deadline (unix ms), how long a
--                ticket outlives its turn (ms), the most tickets the tenant may hold (0: no
--                cap), the concurrency poll (ms); then per bucket its wait kind (0 does not
--                wait: refuses at once; 1 fixed window, 2 sliding, 3 concurrency), its window's
--                end (unix ms) and length (ms).  The ticket is the request's ledger.
--
-- Concurrency: a slot is the ledger in the set, scored by its lease deadline; slots whose
-- lease ran out (their processor died) are dropped before counting.  Settlement removes the
-- slot (the ledger lists its sets as "c:" fields).
--
-- Reclaim: before deciding, up to 8 reservations of this tenant whose lease ran out (their
-- processor died without settling) are settled: the refundable part of each charge goes
-- back to the counters that still exist, and their concurrency slots are freed.  Every key
-- touched shares the tenant's hash tag, so this stays in one Cluster slot.  A reclaimed
-- ledger's record draft is handed back (once: it is removed) with what the ledger had
-- charged and its exact input (note.lua; -1 when none was noted), so the caller writes the
-- usage record its dead processor could not.  The refundable part ("r:" fields) holds the
-- reserved output and, once noted, what admission charged beyond the exact input.
--
-- A replica's allowance ledger (field "alw", allowance.lua) is reclaimed the same way: its "r:"
-- fields are the allowance units the dead replica never opened, given back to their counters.
-- A replica's draft ledger (field "drf", drafts.lua) hands back the usage-record drafts of the
-- requests the dead replica had admitted from its allowances and not settled (drafts_lib.lua),
-- each as a reclaimed request's: its record is written once, as for a ledger of its own.
--
-- Returns {status, {value per bucket}, {ledger, draft, charged, input, ...}, {rider results},
-- allowance units reclaimed, turn, full}:
-- status 1 admitted (values after charging), 0 refused (values as found), 2 duplicate
-- request id (nothing charged; values as found), 3 wait (a ticket is kept until its turn, unix
-- ms); per rider 1 applied, 0 already settled.  A refusal of a waiting request carries the
-- turn it would have needed (0: none computed, -1: never) and 1 when the tenant's queue was
-- full (its cap of tickets).
local riders, K0, A0 = settle_all(1, 1)
K0 = K0 - 1
A0 = A0 - 1
local W = 8
local qlen = tonumber(ARGV[#ARGV])
local n = (#ARGV - A0 - 7 - qlen) / W
local open = KEYS[K0 + n + 2]
local tail = 4 + n * W
local now = tonumber(ARGV[A0 + tail] or '0')
local lease_until = tonumber(ARGV[A0 + tail + 1] or '0')
local draft = ARGV[A0 + tail + 2] or ''
local reclaimed = {}
local alw = 0
if now > 0 then
  local dead = redis.call('ZRANGEBYSCORE', open, '-inf', now, 'LIMIT', 0, 8)
  for _, led in ipairs(dead) do
    redis.call('ZREM', open, led)
    if redis.call('HGET', led, 'state') == 'admitted' then
      local fields = redis.call('HGETALL', led)
      local is_alw = redis.call('HGET', led, 'alw') == '1'
      for j = 1, #fields, 2 do
        local tag = string.sub(fields[j], 1, 2)
        local key = string.sub(fields[j], 3)
        if tag == 'r:' then
          local units = tonumber(fields[j + 1])
          if is_alw and units > 0 and redis.call('EXISTS', key) == 1 then
            alw = alw + units
          end
          take(key, units)
        elseif tag == 'c:' then
          redis.call('ZREM', key, led)
        end
      end
      redis.call('HSET', led, 'state', 'reclaimed')
      if redis.call('HGET', led, 'drf') == '1' then
        reclaim_drafts(led, fields, reclaimed)
      end
      local rec = redis.call('HGET', led, 'rec')
      if rec then
        redis.call('HDEL', led, 'rec')
        reclaimed[#reclaimed + 1] = led
        reclaimed[#reclaimed + 1] = rec
        reclaimed[#reclaimed + 1] = redis.call('HGET', led, 'charged') or '0'
        reclaimed[#reclaimed + 1] = redis.call('HGET', led, 'in') or '-1'
      end
    end
  end
end
local vals = {}
local prev = {}
local raw = {}
local known = {}
for i = 1, n do
  local base = 4 + (i - 1) * W
  prev[i] = 0
  if ARGV[A0 + base] == 'c' then
    redis.call('ZREMRANGEBYSCORE', KEYS[K0 + i + 1], '-inf', now)
    vals[i] = redis.call('ZCARD', KEYS[K0 + i + 1])
  elseif ARGV[A0 + base] == 'u' then
    -- the set's size without this request's end user: what adding it makes it is vals + 1
    local member = KEYS[tonumber(ARGV[A0 + base + 6])]
    known[i] = redis.call('SISMEMBER', KEYS[K0 + i + 1], member) == 1
    vals[i] = redis.call('SCARD', KEYS[K0 + i + 1])
    if known[i] then
      vals[i] = vals[i] - 1
    end
  else
    local p = tonumber(ARGV[A0 + base + 6])
    if p > 0 then
      local before = tonumber(redis.call('GET', KEYS[p]) or '0')
      raw[i] = before
      prev[i] = math.floor(before * tonumber(ARGV[A0 + base + 7]) / 1000000)
    end
    vals[i] = tonumber(redis.call('GET', KEYS[K0 + i + 1]) or '0') + prev[i]
  end
end
local ledger = KEYS[K0 + 1]
local found = redis.call('HGET', ledger, 'state')
if redis.call('HEXISTS', ledger, 'adm') == 1 or found == 'admitted' or found == 'reclaimed'
    or found == 'cancelled' then
  return {2, vals, reclaimed, riders, alw, 0, 0}
end
-- settled before this admission ran (only a journal replay does that): count, open nothing
local closed = found == 'settled'
-- ceil(a / b) of positive integers (exact below 2^52 here)
local function cdiv(a, b)
  return math.floor((a + b - 1) / b)
end
-- the queue: lapsed tickets go, then the units of the waiters ahead of this request
local q0 = #ARGV - qlen
local Q, QL, QT, mine, stamp, score
local ahead_n, ahead_t, sizes = 0, 0, {}
if qlen > 0 then
  local qk = tonumber(ARGV[q0])
  Q, QL, QT = KEYS[qk], KEYS[qk + 1], KEYS[qk + 2]
  local lapsed = redis.call('ZRANGEBYSCORE', QL, '-inf', now)
  for _, t in ipairs(lapsed) do
    redis.call('ZREM', Q, t)
    redis.call('ZREM', QL, t)
    redis.call('HDEL', QT, t)
  end
  mine = redis.call('ZRANK', Q, ledger)
  local ahead
  if mine then
    ahead = mine > 0 and redis.call('ZRANGE', Q, 0, mine - 1) or {}
  else
    -- a newcomer's place: its arrival by Redis's own clock (every replica's tickets in one
    -- order), strictly increasing, less its priority offset; those scored before it are ahead
    local t = redis.call('TIME')
    stamp = tonumber(t[1]) * 1000000 + tonumber(t[2])
    stamp = math.max(stamp, tonumber(redis.call('HGET', QT, '~last') or '0') + 1)
    score = stamp - tonumber(ARGV[q0 + 1]) * 1000
    ahead = redis.call('ZRANGEBYSCORE', Q, '-inf', string.format('(%.17g', score))
  end
  ahead_n = #ahead
  for j = 1, #ahead, 500 do
    local part = redis.call('HMGET', QT, unpack(ahead, j, math.min(j + 499, #ahead)))
    for _, v in ipairs(part) do
      sizes[#sizes + 1] = tonumber(v or '0')
      ahead_t = ahead_t + sizes[#sizes]
    end
  end
end
local function wait_kind(i)
  if qlen == 0 then
    return 0
  end
  return tonumber(ARGV[q0 + 6 + (i - 1) * 3])
end
-- units of the waiters ahead on bucket i (none on a bucket that does not wait)
local function ahead_of(i)
  local wk = wait_kind(i)
  if wk == 0 then
    return 0
  end
  if ARGV[A0 + 4 + (i - 1) * W] == 't' then
    return ahead_t
  end
  return ahead_n
end
local ok = true
for i = 1, n do
  local base = 4 + (i - 1) * W
  local amount = tonumber(ARGV[A0 + base + 1])
  local limit = tonumber(ARGV[A0 + base + 2])
  if ARGV[A0 + base + 5] ~= '1' and amount > 0 and not known[i]
      and vals[i] + ahead_of(i) + amount > limit then
    ok = false
  end
end
local function leave()
  if qlen > 0 and mine then
    redis.call('ZREM', Q, ledger)
    redis.call('ZREM', QL, ledger)
    redis.call('HDEL', QT, ledger)
  end
end
local turn, full = 0, 0
if not ok and qlen > 0 then
  -- wait or refuse at once (extproc/core/waiting.py: decide, turn_ms)
  local deadline = tonumber(ARGV[q0 + 2])
  local poll = tonumber(ARGV[q0 + 5])
  local budget, never, conc = false, false, false
  local rates = now
  turn = now
  for i = 1, n do
    local base = 4 + (i - 1) * W
    local amount = tonumber(ARGV[A0 + base + 1])
    local limit = tonumber(ARGV[A0 + base + 2])
    local wk = wait_kind(i)
    local ahead = ahead_of(i)
    if ARGV[A0 + base + 5] ~= '1' and amount > 0 and not known[i]
        and vals[i] + ahead + amount > limit then
      local t = now
      if wk == 0 then
        budget = true
      elseif amount > limit then
        never = true
      elseif wk == 3 then
        conc = true
        t = now + poll
      else
        local need = ahead + amount
        local ending = tonumber(ARGV[q0 + 7 + (i - 1) * 3])
        local len = math.max(1, tonumber(ARGV[q0 + 8 + (i - 1) * 3]))
        if wk == 1 and ARGV[A0 + base] == 't' then
          -- the waiters ahead, then this request, packed in order from this window on
          local used, windows = vals[i], 0
          sizes[#sizes + 1] = amount
          for _, sz in ipairs(sizes) do
            if used + sz > limit then
              windows, used = windows + 1, 0
            end
            used = used + sz
          end
          sizes[#sizes] = nil
          t = ending + (windows - 1) * len
        elseif wk == 1 then
          local spill = need - math.max(0, limit - vals[i])
          t = ending + (math.ceil(spill / limit) - 1) * len
        else
          -- sliding (extproc/core/waiting.py sliding_turn): each waiter ahead, then this
          -- request, at the first ms its window has room for it, not before the one before it
          local cur, prv = vals[i] - prev[i], raw[i] or 0
          local e = ending
          local s0, at = e - len, now
          local tokens = ARGV[A0 + base] == 't'
          local total = tokens and #sizes or ahead_n
          for u = 1, total + 1 do
            local sz = amount
            if u <= total then
              sz = tokens and sizes[u] or 1
            end
            while true do
              local room = limit - cur - sz
              if room >= 0 then
                local x = s0
                if prv > room then
                  local w = cdiv((room + 1) * 1000000, prv) - 1
                  x = e - cdiv((w + 1) * len, 1000000) + 1
                end
                at = math.max(at, x)
                if at < e then
                  cur = cur + sz
                  break
                end
              end
              prv, cur, s0, e = cur, 0, e, e + len
              at = math.max(at, s0)
            end
          end
          t = at
        end
        t = math.max(now, t)
        rates = math.max(rates, t)
      end
      turn = math.max(turn, t)
    end
  end
  if never then
    turn = -1
    leave()
  elseif budget then
    turn = 0
    leave()
  elseif turn > deadline then
    if conc and now < deadline and rates <= deadline then
      turn = deadline -- a slot may free up any time: one more look at the deadline
    else
      leave()
    end
  end
  local cap = tonumber(ARGV[q0 + 4])
  if turn > 0 and turn <= deadline and not mine and cap > 0 and redis.call('ZCARD', Q) >= cap then
    full = 1 -- refused: the tenant's queue is full
  elseif turn > 0 and turn <= deadline then
    if not mine then
      redis.call('HSET', QT, '~last', stamp)
      redis.call('ZADD', Q, score, ledger)
    end
    local lapse = turn + tonumber(ARGV[q0 + 3])
    redis.call('ZADD', QL, lapse, ledger)
    redis.call('HSET', QT, ledger, ARGV[A0 + 3])
    for _, k in ipairs({Q, QL, QT}) do -- outlive the last lease (never shortened)
      local ttl = redis.call('PTTL', k)
      if ttl < 0 or now + ttl < lapse + 60000 then
        redis.call('PEXPIREAT', k, lapse + 60000)
      end
    end
    return {3, vals, reclaimed, riders, alw, turn, 0}
  end
end
if ok then
  leave()
  if not closed then
    redis.call('HSET', ledger, 'state', 'admitted')
  end
  redis.call('HSET', ledger, 'adm', 1)
  redis.call('HSETNX', ledger, 'seq', 0)
  redis.call('HINCRBY', ledger, 'charged', ARGV[A0 + 3])
  for i = 1, n do
    local base = 4 + (i - 1) * W
    local kind = ARGV[A0 + base]
    local amount = tonumber(ARGV[A0 + base + 1])
    local key = KEYS[K0 + i + 1]
    if kind == 'u' then
      if not known[i] then
        redis.call('SADD', key, KEYS[tonumber(ARGV[A0 + base + 6])])
        redis.call('PEXPIREAT', key, ARGV[A0 + base + 3])
      end
      vals[i] = vals[i] + 1
    elseif kind == 'c' then
      if not closed then -- a settled request holds no slot
        redis.call('ZADD', key, lease_until, ledger)
        redis.call('PEXPIREAT', key, ARGV[A0 + base + 3])
        redis.call('HSET', ledger, 'c:' .. key, 1)
        vals[i] = vals[i] + 1
      end
    elseif amount > 0 then
      if closed then -- what the settlement could not refund yet (settle_lib.lua) is not added
        local owed = tonumber(redis.call('HGET', ledger, 'o:' .. key) or '0')
        local d = math.min(owed, amount)
        if d > 0 then
          redis.call('HINCRBY', ledger, 'o:' .. key, -d)
          amount = amount - d
        end
      end
      vals[i] = redis.call('INCRBY', key, amount) + prev[i]
      redis.call('PEXPIREAT', key, ARGV[A0 + base + 3])
      local refundable = tonumber(ARGV[A0 + base + 4])
      if lease_until > 0 and kind == 't' and refundable > 0 and not closed then
        redis.call('HSET', ledger, 'r:' .. key, refundable)
      end
    end
  end
  if lease_until > 0 and not closed then
    redis.call('ZADD', open, lease_until, ledger)
    redis.call('PEXPIRE', open, ARGV[A0 + 1])
    if draft ~= '' then
      redis.call('HSET', ledger, 'rec', draft)
    end
  end
  redis.call('PEXPIRE', ledger, ARGV[A0 + 1])
  return {1, vals, reclaimed, riders, alw, 0, 0}
end
if ARGV[A0 + 2] == '1' then
  for i = 1, n do
    local base = 4 + (i - 1) * W
    if ARGV[A0 + base] == 'r' then
      vals[i] = redis.call('INCRBY', KEYS[K0 + i + 1], 1) + prev[i]
      redis.call('PEXPIREAT', KEYS[K0 + i + 1], ARGV[A0 + base + 3])
    end
  end
end
return {0, vals, reclaimed, riders, alw, turn, full}
