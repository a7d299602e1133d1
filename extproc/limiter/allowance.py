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
least four of its largest recent amounts), and the script grants at most ``share`` of the
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
(``tranche.lua``) when the open part falls under half a tranche.  If the replica dies, its
lease runs out and the tenant's next admission (``admit.lua``'s reclaim) or take gives the
never-opened tranches back; the leak is what it had opened and not used, about 1.5 tranches.
Opening takes units off the record before the replica may draw from them, and never-opened
units given back are opened first (or the ledger itself is settled), so a reclaim never
refunds units a request used nor units already refunded: strict mode stays exact.

Usage records: a request admitted from an allowance has no ledger in Redis, so its
usage-record draft is kept, batched, in the replica's *draft ledger* for the tenant
(``drafts.lua``: one call every ``draft_flush_ms`` for all of a tenant's new drafts, their
charged figures and the drafts of requests settled since, leased like an allowance ledger and
renewed by those calls).  A request settled before its draft was sent never costs a call.  If
the replica dies, the reclaim of its draft ledger (``admit.lua``, or ``allowance.lua`` on
another replica's take, whose caller's next admission carries them) hands each draft back
once, and the gateway writes the request's record as for a reclaimed ledger of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import structlog

from extproc.clock import Clock, SystemClock
from extproc.core.keys import EXPIRY_SLACK_MS, counter_name
from extproc.core.rules import Adjustment, BucketCharge, UnconfirmedCharge
from extproc.limiter.base import (
    AdmitResult,
    AllowanceGrant,
    AllowanceLease,
    AllowanceTake,
    AllowanceTaker,
    BatchSettler,
    ChargeResult,
    InputNote,
    Limiter,
    Reclaimed,
    SettleCall,
)

if TYPE_CHECKING:
    from extproc.metrics import Metrics

log = structlog.get_logger("extproc")

#: Bucket states kept at most (beyond, new buckets' admissions go to Redis).
MAX_STATES = 50_000
#: Requests admitted from allowances remembered at most (until settled).  Modes that settle
#: nothing (``input_only``, ``reserve_max``, RPM only) never come back: the oldest is forgotten
#: (a later charge or settlement of it goes to Redis, which counts it right all the same).
MAX_LEDGERS = 100_000
#: Settled local ledgers remembered (a duplicate settlement answers "already settled").
MAX_SETTLED = 100_000
#: A bucket state with nothing held and no admission for this long is forgotten.
IDLE_MS = 30_000


class AllowanceBackend(Limiter, AllowanceTaker, BatchSettler, Protocol):
    """What the wrapper needs of the limiter it wraps."""


@dataclass(frozen=True, slots=True)
class AllowanceSettings:
    """How allowances are sized and kept (``AIQ_ALLOWANCE_*``, docs/semantics.md)."""

    share: float = 0.1
    ttl_ms: int = 2_000
    min_rate: float = 8.0
    max_window_s: int = 3_600
    return_ledger_ttl_ms: int = 60_000
    #: a grant is split into this many tranches; the replica draws only from opened ones
    tranches: int = 4
    #: the allowance ledger's lease (``failure.reservation_lease_seconds``): renewed while
    #: this replica lives; once it runs out, the never-opened tranches go back to the tenant
    lease_ms: int = 15_000
    #: how often the usage-record drafts of requests admitted from allowances are sent (a
    #: SIGKILL loses the records of those admitted in the last interval)
    draft_flush_ms: int = 1_000

    @property
    def share_ppm(self) -> int:
        """``share`` in parts per million (the script's unit)."""
        return round(self.share * 1_000_000)


@dataclass(slots=True)
class _Bucket:
    """One counter's allowance on this replica and what this replica saw of the bucket."""

    key: str
    tag: str
    limit: int
    expire_at_ms: int
    units: int = 0  # held: pre-debited in Redis, not drawn yet (``closed`` included)
    closed: int = 0  # of ``units``, not opened yet: recorded in the allowance ledger
    tranche: int = 0  # the last grant's tranche size
    releasing: int = 0  # never-opened units being given back (opened first, then refunded)
    deadline_ms: int = 0  # drawn from until then; the rest then goes back
    seen: int = 0  # the counter's value last answered (every replica's allowances included)
    second: int = 0
    hits: int = 0  # admissions this second
    hits_prev: int = 0  # admissions in the second before
    drawn: int = 0  # units drawn here since ``since_ms`` (the demand sizing follows)
    since_ms: int = 0
    largest: int = 0  # largest amount one admission asked for (decays at each take)
    taking: bool = False
    touched_ms: int = 0
    quiet_until_ms: int = 0  # a take found the tenant near its limit: none asked until then


@dataclass(slots=True)
class _Lease:
    """This replica's allowance ledger for one tenant (allowance.lua, tranche.lua)."""

    ledger: str
    gen: str = ""  # its generation as last answered ("": none yet, or reclaimed)
    opening: bool = False  # a tranche call in flight
    task: asyncio.Task[None] | None = None
    renewed_ms: int = 0


@dataclass(slots=True)
class _Local:
    """A request admitted from allowances (no ledger in Redis unless a charge went there)."""

    seq: int = 0  # the last stream charge's sequence number
    redis_seq: int = 0  # the last charge sent to Redis (0: none; its ledger exists there)
    last_local: tuple[int, tuple[tuple[str, int], ...]] = (0, ())
    settled: bool = False
    remainder: SettleCall | None = None
    tag: str = ""  # the tenant's hash tag (its draft ledger's)
    draft: str = ""  # its usage-record draft ("": none)
    charged: int = 0  # tokens charged: admission and every stream charge (as a ledger's)


@dataclass(slots=True)
class _Drafts:
    """This replica's draft ledger for one tenant (drafts.lua): the usage-record drafts of
    the requests it admitted from allowances and has not settled."""

    ledger: str
    ttl_ms: int = 0
    open: dict[str, None] = dataclasses.field(default_factory=dict)  # not settled
    sent: dict[str, int] = dataclasses.field(default_factory=dict)  # kept: charged as sent
    drops: list[str] = dataclasses.field(default_factory=list)  # sent, settled since
    #: Redis-admitted requests' tokens charged here, not yet in their ledgers' "charged"
    charged_more: dict[str, int] = dataclasses.field(default_factory=dict)
    more_since_ms: int = 0
    pending_ms: int = 0  # since when a draft or a drop waits (0: none)

    def touch(self, now: int) -> None:
        """A draft or a drop now waits for the next flush."""
        if not self.pending_ms:
            self.pending_ms = now

    renewed_ms: int = 0
    flushing: bool = False


@dataclass
class AllowanceStats:
    """What the wrapper did (tests and the bench read it; the metrics export the same)."""

    local_admissions: int = 0
    local_charges: int = 0
    local_settlements: int = 0
    taken: int = 0
    returned: int = 0
    expired: int = 0
    takes: int = 0
    opens: int = 0
    reclaimed: int = 0  # dead replicas' never-opened units this replica's calls gave back
    draft_calls: int = 0  # drafts.lua calls
    drafts_sent: int = 0  # drafts kept in Redis (requests still open at a flush)


class AllowanceLimiter:
    """:class:`extproc.limiter.base.Limiter` around another limiter, with local allowances."""

    def __init__(
        self,
        inner: AllowanceBackend,
        settings: AllowanceSettings | None = None,
        *,
        clock: Clock | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.inner = inner
        self.settings = settings or AllowanceSettings()
        self.clock: Clock = clock or SystemClock()
        self.metrics = metrics
        self.stats = AllowanceStats()
        self._states: dict[str, _Bucket] = {}
        self._ledgers: OrderedDict[str, _Local] = OrderedDict()
        self._settled: OrderedDict[str, None] = OrderedDict()
        self._returns: list[SettleCall] = []
        self._leases: dict[str, _Lease] = {}
        self._drafts: dict[str, _Drafts] = {}
        #: a backend a process death cannot lose counts with (in-memory) keeps no drafts
        self._keeps_drafts = hasattr(inner, "keep_drafts")
        #: requests Redis admitted that had stream charges drawn from allowances
        self._mixed: OrderedDict[str, _Local] = OrderedDict()
        #: drafts of dead replicas' requests a take reclaimed: the next admission carries them
        self._reclaimed: list[Reclaimed] = []
        self._draft_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._instance = uuid.uuid4().hex[:12]
        self._serial = itertools.count()
        self._closed = False

    # -- what the wrapped limiter answers for ------------------------------------------------

    @property
    def round_trips(self) -> int:
        """The wrapped limiter's script calls."""
        return int(getattr(self.inner, "round_trips", 0))

    def configure(self, **kwargs: object) -> None:
        """Pass failure settings to the wrapped limiter (SIGHUP reload)."""
        configure = getattr(self.inner, "configure", None)
        if configure is not None:
            configure(**kwargs)

    async def ping(self) -> bool:
        """Whether the backend answers."""
        return await self.inner.ping()

    async def read(self, keys: list[str]) -> list[int]:
        """Counter values: allowances held by any replica count as used (net of them)."""
        return await self.inner.read(keys)

    async def count_slots(self, keys: list[str], now_ms: int) -> list[int]:
        """Live concurrency slots (never held in allowances)."""
        return await self.inner.count_slots(keys, now_ms)

    # -- admission -----------------------------------------------------------------------------

    def _eligible(self, c: BucketCharge) -> bool:
        if c.kind not in ("rpm", "tpm") or c.shadow or c.prev_key:
            return False
        name = counter_name(c.key)
        return (
            name is not None
            and name.metric in ("rpm", "tpm")
            and name.window_s <= self.settings.max_window_s
        )

    def _state(self, c: BucketCharge, now: int) -> _Bucket | None:
        st = self._states.get(c.key)
        if st is None:
            if len(self._states) >= MAX_STATES:
                return None
            name = counter_name(c.key)
            assert name is not None
            st = self._states[c.key] = _Bucket(
                c.key, name.tag, c.limit, c.expire_at_ms, since_ms=now, touched_ms=now
            )
        st.limit = c.limit
        return st

    def _plan(self, buckets: Sequence[BucketCharge], now: int) -> list[_Bucket] | None:
        """Each bucket's state when every one can be drawn from for its amount, else None."""
        out: list[_Bucket] = []
        for c in buckets:
            st = self._states.get(c.key)
            if (
                st is None
                or not self._eligible(c)
                or now >= st.deadline_ms
                or st.units - st.closed < c.amount
            ):
                return None
            out.append(st)
        return out

    def _values(self, buckets: Sequence[BucketCharge], plan: list[_Bucket]) -> tuple[int, ...]:
        # the counter as last answered: it already includes every allowance (held = used)
        return tuple(max(st.seen, 0) for st in plan)

    async def admit(
        self,
        ledger: str,
        buckets: list[BucketCharge],
        *,
        tpm_charged: int,
        count_refused: bool,
        ledger_ttl_ms: int,
        now_ms: int = 0,
        lease_until_ms: int = 0,
        record_draft: str = "",
        settlements: Sequence[SettleCall] = (),
    ) -> AdmitResult:
        """Admit from the allowances when every bucket holds enough (no Redis call), else
        with the wrapped limiter, the rest of a short allowance riding on the call."""
        now = self.clock.now_ms()
        self._start_sweeper()
        local = all(self._eligible(c) for c in buckets) and bool(buckets)
        if local:
            self._observe(buckets, now)
        plan = self._plan(buckets, now) if local and not settlements else None
        if plan is not None:
            for c, st in zip(buckets, plan, strict=True):
                st.units -= c.amount
            if len(self._ledgers) >= MAX_LEDGERS:
                # the oldest (a request never settled: modes that settle nothing): forgotten,
                # its later calls, if any, go to Redis, which counts them right all the same
                self._draft_done(*self._ledgers.popitem(last=False))
            loc = self._ledgers[ledger] = _Local(tag=plan[0].tag, charged=tpm_charged)
            if record_draft and self._keeps_drafts:
                loc.draft = record_draft
                d = self._draft_ledger(loc.tag)
                d.open[ledger] = None
                d.ttl_ms = max(d.ttl_ms, ledger_ttl_ms)
                d.touch(now)
            self.stats.local_admissions += 1
            self._saved("admit")
            self._refill(buckets, now)
            self._open_ahead(plan)
            return AdmitResult(
                admitted=True,
                duplicate=False,
                values=self._values(buckets, plan),
                reclaimed=self._take_reclaimed(),
            )
        riders = list(settlements)
        if local:
            self._open_short(buckets)
        back = self._give_back_short(buckets, now) if local else None
        if back is not None:
            riders.append(back)
        try:
            res = await self.inner.admit(
                ledger,
                buckets,
                tpm_charged=tpm_charged,
                count_refused=count_refused,
                ledger_ttl_ms=ledger_ttl_ms,
                now_ms=now_ms,
                lease_until_ms=lease_until_ms,
                record_draft=record_draft,
                settlements=riders,
            )
        except BaseException:
            if back is not None:
                self._returns.append(back)  # idempotent by its ledger: sent again later
            raise
        if back is not None:
            self._count("returned", -sum(a.amount for a in back.adjustments))
        if res.allowance_reclaimed:
            self._count("reclaimed", res.allowance_reclaimed)
        if local:
            self._saw(buckets, res.values)
            if res.admitted:
                self._refill(buckets, now)
        if len(riders) != len(settlements) or self._reclaimed:
            res = dataclasses.replace(
                res,
                reclaimed=res.reclaimed + self._take_reclaimed(),
                settled=res.settled[: len(settlements)],
            )
        return res

    def _take_reclaimed(self) -> tuple[Reclaimed, ...]:
        out, self._reclaimed = tuple(self._reclaimed), []
        return out

    def _saw(self, buckets: Sequence[BucketCharge], values: Sequence[int]) -> None:
        """Remember the counters' values Redis answered with (headers of local admissions),
        and give back what is held beyond ``share`` of the room they leave."""
        back: dict[str, list[Adjustment]] = {}
        for c, v in zip(buckets, values, strict=False):
            seen = self._states.get(c.key)
            if seen is not None:
                seen.seen = v
                self._trim(seen, v, back)
        self._queue_returns(back)

    def _trim(self, st: _Bucket, value: int, back: dict[str, list[Adjustment]]) -> None:
        """The room left shrank (other replicas used it): what this replica holds beyond
        ``share`` of it goes back, so that it does not keep the others from the rest."""
        cap = max(0, (st.limit - value) * self.settings.share_ppm // 1_000_000)
        excess = st.units - cap
        if excess > 0 and excess >= max(st.largest, 1):
            self._release(st, excess, back)

    def _queue_returns(self, back: dict[str, list[Adjustment]]) -> None:
        """Send these give-backs in the background (the sweeper retries what fails)."""
        if not back:
            return
        for tag, adj in back.items():
            self._returns.append(self._return_call(tag, adj))
        if not self._closed:
            task = asyncio.get_running_loop().create_task(self._flush_returns())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _observe(
        self, buckets: Sequence[BucketCharge], now: int, *, admission: bool = True
    ) -> None:
        """Count a limiter call (an admission or a stream charge) of these buckets on this
        replica: the rate and the size of its allowances follow."""
        second = now // 1000
        for c in buckets:
            st = self._state(c, now)
            if st is None:
                continue
            if second != st.second:
                st.hits_prev = st.hits if second == st.second + 1 else 0
                st.hits, st.second = 0, second
            st.hits += 1
            st.drawn += c.amount
            if admission:
                st.largest = max(st.largest, c.amount)
            st.touched_ms = now

    def _give_back_short(self, buckets: Sequence[BucketCharge], now: int) -> SettleCall | None:
        """The rest of each allowance too short for this admission, as a refund riding on it."""
        short = [
            st
            for c in buckets
            if (st := self._states.get(c.key)) is not None
            and st.units > 0
            and (st.units < c.amount or now >= st.deadline_ms)
        ]
        if not short:
            return None
        tag = short[0].tag
        lease = self._leases.get(tag)
        mine = [st for st in self._states.values() if st.tag == tag]
        if (
            lease is not None
            and lease.gen
            and not lease.opening
            and not any(st.taking for st in mine)
            and any(st.closed or st.releasing for st in mine)
        ):
            # settle the allowance ledger itself, riding on this admission: its never-opened
            # units (every bucket of the tenant's) and the short ones' opened rest go back at
            # once, the ledger is closed (no reclaim refunds it again; one reclaimed meanwhile
            # has its refund put back first, settle_lib.lua), and the next take opens another
            units: dict[str, int] = {}
            for st in mine:
                give = st.closed + st.releasing + (st.units - st.closed if st in short else 0)
                st.units -= give - st.releasing
                st.closed = st.releasing = 0
                if give:
                    units[st.key] = give
            adj = [Adjustment(key, -n, self._states[key].expire_at_ms) for key, n in units.items()]
            call = SettleCall(lease.ledger, adj, self.settings.return_ledger_ttl_ms)
            self._leases[tag] = _Lease(f"{tag}:req:allow.{self._instance}.{next(self._serial)}")
            return call
        adj = []
        for st in short:
            opened = st.units - st.closed
            self._release(st, st.units, None)  # the never-opened part: in the background
            if opened > 0:
                adj.append(Adjustment(st.key, -opened, st.expire_at_ms))
        return self._return_call(tag, adj) if adj else None

    def _release(self, st: _Bucket, units: int, back: dict[str, list[Adjustment]] | None) -> None:
        """Give back ``units`` of what ``st`` holds: the never-opened part first (opened with
        tranche.lua, then refunded: no reclaim can refund it twice), the rest into ``back``
        (``None``: the caller gives the opened part back itself)."""
        units = min(units, st.units)
        closed = min(units, st.closed)
        st.units -= units
        st.closed -= closed
        if closed:
            st.releasing += closed
            self._schedule_open(st.tag)
        if back is not None and units > closed:
            back.setdefault(st.tag, []).append(Adjustment(st.key, closed - units, st.expire_at_ms))

    def _return_call(self, tag: str, adj: list[Adjustment]) -> SettleCall:
        ledger = f"{tag}:req:allowance.{self._instance}.{next(self._serial)}"
        return SettleCall(ledger, adj, self.settings.return_ledger_ttl_ms)

    def _refill(self, buckets: Sequence[BucketCharge], now: int) -> None:
        """Take (in the background) allowances for the buckets that run short."""
        s = self.settings
        takes: list[AllowanceTake] = []
        busy = False
        for c in buckets:
            st = self._states.get(c.key)
            if st is not None and now < st.quiet_until_ms:
                return  # near its limit: an allowance of the others would not be drawn from
            if st is not None and max(st.hits, st.hits_prev) >= s.min_rate:
                busy = True
        if not busy:  # one busy bucket is enough: a request draws from all of its buckets
            return
        for c in buckets:
            st = self._states.get(c.key)
            if st is None:
                continue
            if st.units and now < st.deadline_ms < now + s.ttl_ms // 2:
                # still drawn from: it stays (its size is bounded by the share at its take);
                # an allowance nobody draws from goes back within ``ttl_ms``
                st.deadline_ms = now + s.ttl_ms
            if st.taking:
                continue
            want = self._want(st, now)
            if st.units * 2 >= want or now + EXPIRY_SLACK_MS >= st.expire_at_ms:
                continue
            cap = (st.limit - st.seen) * s.share_ppm // 1_000_000 - st.units
            if st.seen and cap < max(st.largest, 1):
                if st.units < c.amount:
                    return  # near its limit: the request's other allowances would not be drawn
                continue  # it holds its share of the room left already: a take grants nothing
            takes.append(
                AllowanceTake(
                    st.key,
                    want - st.units,
                    st.limit,
                    st.expire_at_ms,
                    s.share_ppm,
                    st.largest,
                    st.units,
                    st.units - st.closed,
                )
            )
        if not takes or self._closed:
            return
        for t in takes:
            self._states[t.key].taking = True
        task = asyncio.get_running_loop().create_task(self._take(takes))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _want(self, st: _Bucket, now: int) -> int:
        """What to hold: the units drawn here over one allowance's time, at least four of the
        largest recent admissions."""
        elapsed = max(now - st.since_ms, 100)
        per_ms = st.drawn / elapsed
        return max(math.ceil(per_ms * self.settings.ttl_ms * 1.25), 4 * st.largest, 1)

    def _lease(self, tag: str) -> _Lease:
        lease = self._leases.get(tag)
        if lease is None:
            lease = self._leases[tag] = _Lease(
                f"{tag}:req:allow.{self._instance}.{next(self._serial)}"
            )
        return lease

    async def _take(self, takes: list[AllowanceTake]) -> None:
        s = self.settings
        tag = self._states[takes[0].key].tag
        lease = self._lease(tag)
        now = self.clock.now_ms()
        terms = AllowanceLease(
            lease.ledger,
            now,
            now + s.lease_ms,
            max(s.tranches, 1),
            s.max_window_s * 1000 + s.lease_ms + EXPIRY_SLACK_MS,
        )
        try:
            results: list[AllowanceGrant | None] = await self.inner.take_allowances(takes, terms)
        except Exception:  # a wrapped limiter that raises: no allowance, admission as before
            results = [None] * len(takes)
        now = self.clock.now_ms()
        near: dict[str, list[Adjustment]] = {}
        answered = [r for r in results if r is not None]
        if answered:
            lease.renewed_ms = now
            if answered[0].reclaimed:
                self._count("reclaimed", answered[0].reclaimed)
            if answered[0].drafts and len(self._reclaimed) < MAX_LEDGERS:
                self._reclaimed.extend(answered[0].drafts)
            if answered[0].gen != lease.gen:
                # a new ledger: what the old one recorded was reclaimed (or lost): those
                # never-opened units are no longer this replica's to draw nor to give back
                self._drop_closed(tag)
                lease.gen = answered[0].gen
        for t, r in zip(takes, results, strict=True):
            self.stats.takes += 1
            st = self._states.get(t.key)
            if r is None:
                self._count_take("failed")
                if st is not None:
                    st.taking = False
                continue
            grant, value = r.granted, r.value
            if st is None:  # forgotten meanwhile (cannot happen while taking): give it back
                name = counter_name(t.key)
                if grant and name is not None:
                    near.setdefault(name.tag, []).append(Adjustment(t.key, -grant, t.expire_at_ms))
                continue
            st.taking = False
            st.seen = value
            st.drawn, st.since_ms, st.largest = 0, now, st.largest // 2 or st.largest
            if grant > 0:
                self._count_take("granted")
                self._count("taken", grant)
                st.units += grant
                st.tranche = max(-(-(t.held + grant) // max(s.tranches, 1)), t.least)
                # what brings the open part up to one tranche is open at once (allowance.lua)
                st.closed += grant - max(0, min(grant, st.tranche - t.opened))
                st.deadline_ms = now + self.settings.ttl_ms
            elif (t.limit - value) * t.share_ppm // 1_000_000 >= max(t.least, 1):
                self._count_take("none")  # it holds its share already: not near the limit
                self._trim(st, value, near)  # ... or more, the room having shrunk
            else:
                # near the limit: nothing taken, none asked for a while, and what is still
                # held goes back now
                self._count_take("none")
                st.quiet_until_ms = now + self.settings.ttl_ms
                if st.units > 0:
                    self._release(st, st.units, near)
        for rtag, adj in near.items():
            self._returns.append(self._return_call(rtag, adj))
        if near:
            await self._flush_returns()

    # -- tranches ------------------------------------------------------------------------------

    def _drop_closed(self, tag: str) -> None:
        """The tenant's allowance ledger was reclaimed: forget its never-opened units."""
        for st in self._states.values():
            if st.tag == tag and (st.closed or st.releasing):
                st.units -= st.closed
                st.closed = 0
                st.releasing = 0

    def _needs_open(self, st: _Bucket) -> bool:
        return st.closed > 0 and st.units - st.closed < max(st.tranche // 2, st.largest, 1)

    def _open_short(self, buckets: Sequence[BucketCharge]) -> None:
        """An allowance that holds the amount but has not opened enough of it: open the next
        tranche now (this call goes to Redis; the next ones draw from it)."""
        for c in buckets:
            st = self._states.get(c.key)
            if st is not None and st.closed and st.units - st.closed < c.amount <= st.units:
                self._schedule_open(st.tag)

    def _open_ahead(self, plan: Sequence[_Bucket]) -> None:
        """Open the next tranche, in the background, of each allowance half drawn."""
        for st in plan:
            if self._needs_open(st):
                self._schedule_open(st.tag)

    def _schedule_open(self, tag: str) -> None:
        lease = self._lease(tag)
        if lease.opening or self._closed or not lease.gen:
            return
        lease.opening = True
        task = lease.task = asyncio.get_running_loop().create_task(self._open(tag, lease))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open(self, tag: str, lease: _Lease) -> None:
        """tranche.lua for the tenant: open a tranche of each allowance that needs one and
        the never-opened units being given back (then refunded as opened ones)."""
        try:
            for _ in range(4):  # what became due meanwhile, a few times at most
                plan: list[tuple[_Bucket, int, int]] = []
                for st in self._states.values():
                    if st.tag != tag:
                        continue
                    ahead = min(st.closed, st.tranche) if self._needs_open(st) else 0
                    if ahead or st.releasing:
                        plan.append((st, st.releasing, ahead))
                if not plan or not lease.gen:
                    return
                gen = lease.gen
                opener = getattr(self.inner, "open_tranches", None)
                if opener is None:
                    return
                items = [(st.key, rel + ahead) for st, rel, ahead in plan]
                try:
                    ok: bool | None = await opener(lease.ledger, gen, items)
                except Exception:
                    ok = None
                self.stats.opens += 1
                if ok is None:
                    return  # the sweeper tries again
                if lease.gen != gen:
                    return  # a newer ledger meanwhile: this one's units were dropped already
                if not ok:  # reclaimed (a lease renewal lost): its record went back already
                    self._drop_closed(tag)
                    lease.gen = ""
                    return
                back: dict[str, list[Adjustment]] = {}
                for st, rel, ahead in plan:
                    st.releasing -= rel
                    opened = min(ahead, st.closed)
                    st.closed -= opened
                    # what a give-back moved out of ``closed`` meanwhile: opened, so refunded
                    refund = rel + ahead - opened
                    st.releasing -= ahead - opened
                    if refund > 0:
                        back.setdefault(tag, []).append(
                            Adjustment(st.key, -refund, st.expire_at_ms)
                        )
                if back:
                    self._queue_returns(back)
        finally:
            lease.opening = False

    async def _renew_leases(self, force: bool = False) -> None:
        """Renew the allowance ledgers that still record never-opened units (every third
        of the lease), as the gateway renews its reservations."""
        now = self.clock.now_ms()
        s = self.settings
        held = {st.tag for st in self._states.values() if st.closed or st.releasing}
        due = [
            lease.ledger
            for tag, lease in self._leases.items()
            if tag in held and lease.gen and (force or now - lease.renewed_ms >= s.lease_ms // 3)
        ]
        if not due:
            return
        with contextlib.suppress(Exception):
            await self.inner.renew(due, now + s.lease_ms)
            for lease in self._leases.values():
                if lease.ledger in due:
                    lease.renewed_ms = now

    # -- stream charges ------------------------------------------------------------------------

    async def charge(
        self,
        ledger: str,
        seq: int,
        buckets: list[BucketCharge],
        amount: int,
        *,
        strict: bool,
        ledger_ttl_ms: int,
    ) -> ChargeResult:
        """Draw a locally admitted request's charge from the allowances when they hold it,
        else charge in Redis (strict or lazy, as the wrapped limiter does)."""
        loc = self._ledgers.get(ledger)
        now = self.clock.now_ms()
        if buckets and all(self._eligible(c) for c in buckets):
            self._observe(buckets, now, admission=False)  # the demand sizing follows
            self._refill(buckets, now)
        if loc is None and ledger not in self._settled:
            return await self._charge_mixed(
                ledger, seq, buckets, amount, strict=strict, ledger_ttl_ms=ledger_ttl_ms
            )
        if loc is not None and not loc.settled:
            if seq <= loc.seq and seq == loc.last_local[0]:
                return ChargeResult(granted=amount, exhausted=False, values=())
            plan = self._plan(buckets, now) if seq > loc.seq else None
            if plan is not None:
                drawn = []
                for c, st in zip(buckets, plan, strict=True):
                    st.units -= c.amount
                    drawn.append((st.key, c.amount))
                loc.seq = seq
                loc.last_local = (seq, tuple(drawn))
                loc.charged += amount
                self.stats.local_charges += 1
                self._saved("charge")
                self._open_ahead(plan)
                return ChargeResult(
                    granted=amount, exhausted=False, values=self._values(buckets, plan)
                )
            if seq > loc.seq:
                self._open_short(buckets)
            res = await self.inner.charge(
                ledger, seq, buckets, amount, strict=strict, ledger_ttl_ms=ledger_ttl_ms
            )
            if seq > loc.seq:
                loc.charged += res.granted
            loc.seq = max(loc.seq, seq)
            loc.redis_seq = max(loc.redis_seq, seq)
            self._saw(buckets, res.values)
            return res
        return await self.inner.charge(
            ledger, seq, buckets, amount, strict=strict, ledger_ttl_ms=ledger_ttl_ms
        )

    async def _charge_mixed(
        self,
        ledger: str,
        seq: int,
        buckets: list[BucketCharge],
        amount: int,
        *,
        strict: bool,
        ledger_ttl_ms: int,
    ) -> ChargeResult:
        """A charge of a request Redis admitted: drawn from the allowances when they hold it
        (its ledger stays in Redis: the settlement's corrections go there as usual, counted
        against what the gateway was granted, local draws included), else charged in Redis."""
        mix = self._mixed.get(ledger)
        if mix is not None and seq <= mix.seq and seq == mix.last_local[0]:
            return ChargeResult(granted=amount, exhausted=False, values=())  # a retry
        now = self.clock.now_ms()
        plan = self._plan(buckets, now) if buckets and (mix is None or seq > mix.seq) else None
        if plan is not None:
            if mix is None:
                if len(self._mixed) >= MAX_LEDGERS:
                    self._mixed.popitem(last=False)  # a request never settled: forgotten
                mix = self._mixed[ledger] = _Local(tag=plan[0].tag)
            drawn = []
            for c, st in zip(buckets, plan, strict=True):
                st.units -= c.amount
                drawn.append((st.key, c.amount))
            mix.seq = seq
            mix.last_local = (seq, tuple(drawn))
            if self._keeps_drafts:
                # not in its ledger's "charged" (what a reclaim bills): a later flush adds it
                d = self._draft_ledger(mix.tag)
                if not d.charged_more:
                    d.more_since_ms = now
                d.charged_more[ledger] = d.charged_more.get(ledger, 0) + amount
            self.stats.local_charges += 1
            self._saved("charge")
            self._open_ahead(plan)
            return ChargeResult(granted=amount, exhausted=False, values=self._values(buckets, plan))
        if buckets and all(self._eligible(c) for c in buckets):
            self._open_short(buckets)
        res = await self.inner.charge(
            ledger, seq, buckets, amount, strict=strict, ledger_ttl_ms=ledger_ttl_ms
        )
        if mix is not None:
            mix.seq = max(mix.seq, seq)
            mix.redis_seq = max(mix.redis_seq, seq)
        if buckets and all(self._eligible(c) for c in buckets):
            self._saw(buckets, res.values)
        return res

    def _settle_mixed(self, call: SettleCall) -> SettleCall:
        """The settlement of a Redis-admitted request whose last charge was drawn here and not
        confirmed to the gateway: its units go back into the allowance (the corrections were
        computed without it), and Redis, which never saw that charge, takes nothing back."""
        mix = self._mixed.pop(call.ledger, None)
        if mix is None:
            return call
        d = self._drafts.get(mix.tag)
        if d is not None:
            d.charged_more.pop(call.ledger, None)  # settled: no reclaim will bill it
        u = call.unconfirmed
        if u is None or u.seq != mix.last_local[0]:
            return call
        now = self.clock.now_ms()
        extra: list[Adjustment] = []
        for key, units in mix.last_local[1]:
            self._put_back(key, units, now, extra)
        return dataclasses.replace(call, adjustments=[*call.adjustments, *extra], unconfirmed=None)

    # -- settlement ----------------------------------------------------------------------------

    def _settle_local(self, call: SettleCall) -> tuple[bool, SettleCall | None]:
        """Settle a locally admitted request here: (applied, what must still go to Redis)."""
        loc = self._ledgers.get(call.ledger)
        if loc is None:
            return False, None
        if loc.settled:
            return False, loc.remainder
        loc.settled = True
        self._draft_done(call.ledger, loc)
        now = self.clock.now_ms()
        to_redis: list[Adjustment] = []
        unconfirmed: UnconfirmedCharge | None = call.unconfirmed
        if unconfirmed is not None and unconfirmed.seq == loc.last_local[0]:
            # drawn here, its answer not waited for: the corrections were computed without it
            for key, units in loc.last_local[1]:
                self._put_back(key, units, now, to_redis)
            unconfirmed = None
        elif unconfirmed is not None and unconfirmed.seq > loc.redis_seq:
            unconfirmed = None  # never sent: nothing to take back
        for a in call.adjustments:
            if a.amount < 0:
                self._put_back(a.key, -a.amount, now, to_redis, a.expire_at_ms)
            elif a.amount > 0:
                st = self._states.get(a.key)
                if st is not None and now < st.deadline_ms and st.units - st.closed >= a.amount:
                    st.units -= a.amount
                else:
                    to_redis.append(a)
        self.stats.local_settlements += 1
        self._saved("settle")
        if to_redis or unconfirmed is not None:
            loc.remainder = SettleCall(
                call.ledger, to_redis, call.ledger_ttl_ms, unconfirmed=unconfirmed
            )
        else:
            self._forget(call.ledger)
        return True, loc.remainder

    def _put_back(
        self, key: str, units: int, now: int, to_redis: list[Adjustment], expire_at: int = 0
    ) -> None:
        """A refund into the key's allowance (its window still running), else to Redis."""
        st = self._states.get(key)
        if st is not None and now + EXPIRY_SLACK_MS < st.expire_at_ms:
            st.units += units  # past its time, the sweeper gives it back on its next turn
        else:
            to_redis.append(Adjustment(key, -units, expire_at or (st.expire_at_ms if st else 0)))

    def _forget(self, ledger: str) -> None:
        self._ledgers.pop(ledger, None)
        self._settled[ledger] = None
        if len(self._settled) > MAX_SETTLED:
            self._settled.popitem(last=False)

    def _remainder_done(self, ledger: str) -> None:
        loc = self._ledgers.get(ledger)
        if loc is not None:
            loc.remainder = None
            self._forget(ledger)

    async def settle(
        self,
        ledger: str,
        adjustments: list[Adjustment],
        *,
        ledger_ttl_ms: int,
        cancel: bool = False,
        unconfirmed: UnconfirmedCharge | None = None,
    ) -> bool:
        """Settle a locally admitted request into the allowances (what does not fit goes to
        Redis); any other with the wrapped limiter."""
        if ledger in self._settled:
            return False
        if ledger not in self._ledgers:
            call = self._settle_mixed(
                SettleCall(ledger, adjustments, ledger_ttl_ms, cancel, unconfirmed)
            )
            return await self.inner.settle(
                ledger,
                call.adjustments,
                ledger_ttl_ms=ledger_ttl_ms,
                cancel=cancel,
                unconfirmed=call.unconfirmed,
            )
        applied, rest = self._settle_local(
            SettleCall(ledger, adjustments, ledger_ttl_ms, cancel, unconfirmed)
        )
        if rest is not None:
            await self.inner.settle(
                rest.ledger,
                rest.adjustments,
                ledger_ttl_ms=rest.ledger_ttl_ms,
                unconfirmed=rest.unconfirmed,
            )
            self._remainder_done(ledger)
            return True
        return applied

    async def settle_many(self, items: list[SettleCall]) -> list[bool | None]:
        """:meth:`settle` for many; the Redis parts in the wrapped limiter's batch calls."""
        out: list[bool | None] = [None] * len(items)
        remote: list[SettleCall] = []
        where: list[tuple[int, bool]] = []  # (item index, a local request's remainder)
        for i, call in enumerate(items):
            if call.ledger in self._settled:
                out[i] = False
                continue
            if call.ledger not in self._ledgers:
                remote.append(self._settle_mixed(call))
                where.append((i, False))
                continue
            applied, rest = self._settle_local(call)
            if rest is None:
                out[i] = applied
            else:
                remote.append(rest)
                where.append((i, True))
        if remote:
            results = await self.inner.settle_many(remote)
            for (i, is_rest), r in zip(where, results, strict=True):
                if is_rest:
                    if r is not None:
                        self._remainder_done(items[i].ledger)
                        out[i] = True
                else:
                    out[i] = r
        return out

    async def note_inputs(self, notes: list[InputNote]) -> list[bool | None]:
        """Locally admitted requests have no ledger in Redis to note (False); the others go
        to the wrapped limiter."""
        out: list[bool | None] = [False] * len(notes)
        remote = [i for i, n in enumerate(notes) if n.ledger not in self._ledgers]
        noter = getattr(self.inner, "note_inputs", None)
        if remote and noter is not None:
            results = await noter([notes[i] for i in remote])
            for i, r in zip(remote, results, strict=True):
                out[i] = r
        return out

    async def renew(
        self, ledgers: list[str], until_ms: int, *, held: dict[str, list[str]] | None = None
    ) -> None:
        """Renew the leases of the requests admitted by Redis (local ones hold none) and of
        this replica's allowance ledgers that record never-opened units."""
        remote = [led for led in ledgers if led not in self._ledgers]
        tags = {st.tag for st in self._states.values() if st.closed or st.releasing}
        leases = [self._leases[t] for t in tags if t in self._leases and self._leases[t].gen]
        remote += [lease.ledger for lease in leases]
        if remote:
            await self.inner.renew(remote, until_ms, held=held)
            now = self.clock.now_ms()
            for lease in leases:
                lease.renewed_ms = now

    # -- giving back ---------------------------------------------------------------------------

    def _start_sweeper(self) -> None:
        if self._sweeper is None and not self._closed:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.create_task(self._sweep_loop())
            self._draft_task = loop.create_task(self._draft_loop())

    # -- usage-record drafts -------------------------------------------------------------------

    def _draft_ledger(self, tag: str) -> _Drafts:
        d = self._drafts.get(tag)
        if d is None:
            d = self._drafts[tag] = _Drafts(f"{tag}:req:drafts.{self._instance}")
        return d

    def _draft_done(self, ledger: str, loc: _Local) -> None:
        """A local request settled (or forgotten): its draft leaves the draft ledger (by the
        next flush, if it was sent)."""
        if not loc.draft:
            return
        d = self._drafts.get(loc.tag)
        if d is None:
            return
        d.open.pop(ledger, None)
        if d.sent.pop(ledger, None) is not None:
            d.drops.append(ledger)
            d.touch(self.clock.now_ms())

    async def _draft_loop(self) -> None:
        tick = min(max(self.settings.draft_flush_ms, 1), 100) / 2000
        while True:
            await asyncio.sleep(tick)
            await self.flush_drafts()

    async def flush_drafts(self, *, force: bool = False) -> None:
        """Send each tenant's drafts and drops once the oldest waited ``draft_flush_ms`` (a
        request settled sooner costs nothing), with the charged figures (one call a tenant);
        renew the draft ledgers still holding drafts every third of the lease."""
        now = self.clock.now_ms()
        third = self.settings.lease_ms // 3
        wait = 0 if force else self.settings.draft_flush_ms
        due = []
        for d in self._drafts.values():
            if d.flushing:
                continue
            if not (len(d.open) > len(d.sent) or d.drops):
                d.pending_ms = 0  # what was waiting settled before it was sent
            if (
                (d.pending_ms and now - d.pending_ms >= wait)
                or (d.sent and (force or now - d.renewed_ms >= third))
                or (d.charged_more and (force or now - d.more_since_ms >= third))
            ):
                due.append(d)
        if due:
            await asyncio.gather(*(self._flush_drafts(d) for d in due))
        for tag, d in list(self._drafts.items()):
            if not (d.open or d.sent or d.drops or d.charged_more or d.flushing):
                del self._drafts[tag]

    async def _flush_drafts(self, d: _Drafts) -> None:
        keeper = getattr(self.inner, "keep_drafts", None)
        if keeper is None:
            return
        d.flushing = True
        try:
            before = set(d.sent)
            keep = [
                (led, loc.charged, loc.draft)
                for led in d.open
                if led not in d.sent and (loc := self._ledgers.get(led)) is not None
            ]
            charged = [
                (led, loc.charged)
                for led, c in d.sent.items()
                if (loc := self._ledgers.get(led)) is not None and loc.charged != c
            ]
            drops, d.drops = d.drops, []
            more, d.charged_more = d.charged_more, {}
            d.pending_ms = 0
            now = self.clock.now_ms()
            s = self.settings
            try:
                ok: bool | None = await keeper(
                    d.ledger,
                    now + s.lease_ms,
                    d.ttl_ms + s.lease_ms,
                    keep=keep,
                    charged=charged,
                    drop=drops,
                    more=list(more.items()),
                )
            except Exception:
                ok = None
            self.stats.draft_calls += 1
            if ok is None:  # sent again at the next flush
                d.drops = drops + d.drops
                d.touch(now)
                for led, n in more.items():
                    d.charged_more[led] = d.charged_more.get(led, 0) + n
                return
            d.renewed_ms = now
            self.stats.drafts_sent += len(keep)
            for led, c in charged:
                if led in d.sent:
                    d.sent[led] = c
            if not ok and before:
                # created anew (reclaimed, lost): the drafts sent before go again
                for led in before:
                    d.sent.pop(led, None)
                d.touch(now)
            for led, c, _ in keep:
                if led in d.open:
                    d.sent[led] = c
                else:
                    d.drops.append(led)  # settled while this call was on its way
                    d.touch(now)
        finally:
            d.flushing = False

    async def _sweep_loop(self) -> None:
        # a quarter of an allowance's time, and often enough to renew the allowance ledgers'
        # leases every third of theirs
        tick = max(min(self.settings.ttl_ms / 4000, self.settings.lease_ms / 6000), 0.05)
        while True:
            await asyncio.sleep(tick)
            self.sweep()
            for tag in list(self._leases):
                if any(st.tag == tag and st.releasing for st in self._states.values()):
                    self._schedule_open(tag)
            if self._returns:
                await self._flush_returns()
            await self._renew_leases()

    def sweep(self) -> None:
        """Give back what allowances past their time hold; drop those whose window ended and
        the states nobody used for a while (queued: :meth:`_flush_returns` sends them)."""
        now = self.clock.now_ms()
        back: dict[str, list[Adjustment]] = {}
        for key, st in list(self._states.items()):
            if now + EXPIRY_SLACK_MS >= st.expire_at_ms:
                if st.units:
                    self._count("expired", st.units)
                if not st.taking:
                    del self._states[key]
                st.units = st.closed = st.releasing = 0
                continue
            if st.units and now >= st.deadline_ms:
                self._release(st, st.units, back)
            elif (
                not st.units
                and not st.releasing
                and not st.taking
                and now - st.touched_ms > IDLE_MS
            ):
                del self._states[key]
        for tag, adj in back.items():
            self._returns.append(self._return_call(tag, adj))

    async def _release_now(self) -> None:
        """Open (then refund) the never-opened units being given back, now."""
        for tag, lease in list(self._leases.items()):
            if lease.task is not None and not lease.task.done():
                with contextlib.suppress(Exception):
                    await asyncio.shield(lease.task)
            if not lease.opening and any(
                st.tag == tag and st.releasing for st in self._states.values()
            ):
                lease.opening = True
                await self._open(tag, lease)

    async def _flush_returns(self) -> None:
        await self._release_now()
        calls, self._returns = self._returns, []
        if not calls:
            return
        try:
            results = await self.inner.settle_many(calls)
        except Exception:
            results = [None] * len(calls)
        for call, r in zip(calls, results, strict=True):
            if r is None:
                self._returns.append(call)  # idempotent by its ledger: sent again
            elif r:
                self._count("returned", -sum(a.amount for a in call.adjustments))

    async def give_back(self) -> None:
        """Give back everything held now (shutdown; tests)."""
        for st in self._states.values():
            st.deadline_ms = 0
        self.sweep()
        await self._flush_returns()

    async def close(self) -> None:
        """Give back what is held (best effort), stop the background tasks, close the
        wrapped limiter."""
        self._closed = True
        for task in (self._sweeper, self._draft_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.give_back(), timeout=2.0)
        with contextlib.suppress(Exception):
            # drafts of requests settled since the last flush leave the draft ledgers (those
            # still open stay: if this process never settles them, the reclaim records them)
            await asyncio.wait_for(self.flush_drafts(force=True), timeout=2.0)
        log.info(
            "allowances_closed", **dataclasses.asdict(self.stats), unreturned=self._unreturned()
        )
        await self.inner.close()

    def _unreturned(self) -> int:
        return -sum(a.amount for c in self._returns for a in c.adjustments)

    # -- metrics -------------------------------------------------------------------------------

    def _count(self, event: str, units: int) -> None:
        if event == "taken":
            self.stats.taken += units
        elif event == "returned":
            self.stats.returned += units
        elif event == "expired":
            self.stats.expired += units
        elif event == "reclaimed":
            self.stats.reclaimed += units
        m = self.metrics
        if m is not None and units > 0:
            m.allowance_units.labels(event).inc(units)

    def _count_take(self, outcome: str) -> None:
        m = self.metrics
        if m is not None:
            m.allowance_takes.labels(outcome).inc()

    def _saved(self, call: str) -> None:
        m = self.metrics
        if m is not None:
            m.allowance_saved_calls.labels(call).inc()
