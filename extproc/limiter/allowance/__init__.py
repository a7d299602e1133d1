"""Local allowances: admission without a Redis round trip for tenants far from their limits.

:class:`AllowanceLimiter` wraps the Redis (or in-memory) limiter.  For a busy bucket of a
tenant far from its limit it takes an *allowance*: units pre-debited in Redis by one
``allowance.lua`` call, so other replicas and the usage API see them as used at once.  Then:

- an admission whose every bucket holds enough allowance is admitted in process, drawing from
  each (all or nothing), with no Redis call and no ledger in Redis; any other admission goes to
  the admission script as before;
- a stream charge of such a request draws from the allowance the same way (else Redis);
- its settlement puts a refund back into the allowance and draws a shortfall from it; what
  does not fit goes to Redis as an ordinary settlement of the same ledger;
- what an allowance still holds goes back to Redis (a refund through ``settle.lua``) when its
  time is up (``ttl_ms``), when admission had to go to Redis because it fell short (the rest
  rides on that admission call, applied before its check, so the request may use it), when a
  take found the tenant near its limit, the part beyond ``share`` of the room left whenever a
  Redis answer shows that room shrank, and on shutdown.  An allowance whose window ended is
  dropped (its counter no longer counts).

Sizing: a bucket gets an allowance only when this replica makes at least ``min_rate`` limiter
calls a second on it (admissions and stream charges); it asks for what the bucket drew here over the last ``ttl_ms`` (at
least four of its largest recent amounts) once it holds under half of that (with tranches
still to open: at the opening that would leave it there, which the take then makes, or under
a quarter), the request's other buckets riding on the call, and the script grants at most ``share`` of the
room left (``limit - value``), what the replica still holds of it included (held + grant <=
share x room), and nothing when that is less than the largest recent amount.
Near the limit allowances therefore shrink to nothing and every admission goes to Redis,
which judges it against a counter that includes every replica's allowances: strict mode
never exceeds a limit, lazy mode keeps its per-stream bound.

Only fixed-window request and token counters (``rpm``, ``tpm``) with windows up to
``max_window_s`` take allowances.  A request touching any other bucket (a concurrency limit,
a money budget or weighted tokens, a sliding window, a shadow limit) is admitted by Redis as
before, whole.

Tranches: a take's grant is split into tranches; the replica draws only from those it has
opened.  What is not open is recorded in the replica's allowance ledger for the tenant (a
hash leased in the tenant's open reservations like a request's ledger, renewed every third
of ``lease_ms`` while the replica lives); the next tranche is opened in the background
(``tranche.lua``) when the open part falls under half a tranche, the tenant's other allowances
under one open tranche riding on the call (topped up to one and a half, as much as a take
opens at once).  If the replica dies, its
lease runs out and the tenant's next admission (``admit.lua``'s reclaim) or take gives the
never-opened tranches back; the leak is what it had opened and not used, about 1.5 tranches.
Opening takes units off the record before the replica may draw from them, and never-opened
units given back are opened first (or the ledger itself is settled), so a reclaim never
refunds units a request used nor units already refunded: strict mode stays exact.

Usage records: a request admitted from an allowance has no ledger in Redis, so its
usage-record draft is kept, batched, in the replica's *draft ledger* for the tenant
(``drafts.lua``: once a draft has itself waited ``draft_flush_ms``, one call for all of a tenant's new drafts, their
charged figures and the drafts of requests settled since, leased like an allowance ledger and
renewed by those calls).  A request settled before its draft was sent never costs a call.  If
the replica dies, the reclaim of its draft ledger (``admit.lua``, or ``allowance.lua`` on
another replica's take, whose caller's next admission carries them) hands each draft back
once, and the gateway writes the request's record as for a reclaimed ledger of its own.

The code, one module a job, by composition: :mod:`.state` (settings, bounds, the records and
the :class:`.state.Book` that holds every one of them), :mod:`.limiter` (:class:`AllowanceLimiter`:
admissions and stream charges, served from allowances all or nothing, else by the wrapped
limiter; it builds the book and the parts below, each given the book and the wrapped limiter),
:mod:`.taking` (demand seen and takes), :mod:`.returns` (give-backs and the sweeper),
:mod:`.tranches` (opening tranches, the allowance ledgers' leases), :mod:`.drafts` (the draft
ledgers and their flushes), :mod:`.settling` (settlements into the allowances, the rest to
Redis), :mod:`.sizing` (the arithmetic: what a bucket wants, its share of the room, grants and
tranche sizes), :mod:`.store` (the allowance scripts' calls in Redis) and :mod:`.stats` (counts
and metrics).
"""

from extproc.limiter.allowance.limiter import AllowanceLimiter
from extproc.limiter.allowance.state import AllowanceBackend, AllowanceSettings
from extproc.limiter.allowance.stats import AllowanceStats

__all__ = ["AllowanceBackend", "AllowanceLimiter", "AllowanceSettings", "AllowanceStats"]
