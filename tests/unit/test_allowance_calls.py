"""How many limiter calls allowances cost once warm (issue 35: at most one per 500-token
stream with two processors), on the in-memory limiter and a fake clock: the rules that keep
takes, tranche openings and draft-ledger flushes few, and the bounds they must keep (the open
part of an allowance, what a SIGKILL leaks, stays within 1.5 tranches; a draft waits at most
``draft_flush_ms``)."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.clock import FakeClock
from extproc.core.rules import Adjustment, BucketCharge
from extproc.limiter.allowance import AllowanceLimiter, AllowanceSettings
from extproc.limiter.allowance.sizing import take_due, to_open, tops_up
from extproc.limiter.base import (
    AdmitCall,
    AllowanceGrant,
    AllowanceLease,
    AllowanceTake,
    SettleCall,
)
from extproc.limiter.memory import MemoryLimiter

pytestmark = pytest.mark.unit

TAG = "aiq:{t1}"
TPM = f"{TAG}:tpm:t:*:3600:1"
RPM = f"{TAG}:rpm:t:*:3600:1"
TTL = 60_000


class Counting(MemoryLimiter):
    """The in-memory limiter counting its calls by script, keeping drafts like Redis does
    (``keep_drafts``: answered, the drafts themselves only counted) unless ``down``."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.calls: Counter[str] = Counter()
        self.kept: list[list[str]] = []
        self.down = False

    async def take_allowances(
        self, items: list[AllowanceTake], lease: AllowanceLease | None = None
    ) -> list[AllowanceGrant | None]:
        self.calls["allowance"] += 1
        return await super().take_allowances(items, lease)

    async def open_tranches(
        self, ledger: str, gen: str, items: list[tuple[str, int]]
    ) -> bool | None:
        self.calls["tranche"] += 1
        return await super().open_tranches(ledger, gen, items)

    async def keep_drafts(
        self,
        ledger: str,
        until_ms: int,
        ttl_ms: int,
        *,
        keep: Sequence[tuple[str, int, str]],
        charged: Sequence[tuple[str, int]],
        drop: Sequence[str],
        more: Sequence[tuple[str, int]] = (),
    ) -> bool | None:
        self.calls["drafts"] += 1
        if self.down:
            return None
        self.kept.append([k[0] for k in keep])
        return True


@dataclass
class Stream:
    """One stream in flight: its replica and worker, ledger, start and charges made."""

    replica: int
    worker: int
    ledger: str
    started: int
    charges: int = 0


def charges(end: int, amount: int) -> list[BucketCharge]:
    return [
        BucketCharge(RPM, "rpm", 1, 10**12, end),
        BucketCharge(TPM, "tpm", amount, 10**12, end, refundable=amount),
    ]


async def settle_background(lims: Sequence[AllowanceLimiter]) -> None:
    """Let the background calls (takes, openings, give-backs) run to their answers."""
    for lim in lims:
        for _ in range(3):
            await asyncio.sleep(0)
        while lim.book.tasks:
            await asyncio.gather(*list(lim.book.tasks))


async def streams(
    clock: FakeClock,
    store: Counting,
    lims: Sequence[AllowanceLimiter],
    *,
    seconds: float,
    stream_ms: int,
    workers: int = 2,
) -> tuple[int, int, int]:
    """Closed-loop streams on each replica (``workers`` at a time), like the bench's 500-token
    streams: an admission of 108 tokens (and one request), eight stream charges of 64 tokens
    spread over ``stream_ms``, a settlement; the drafts flushed and the sweeper's work done on
    the fake clock; none starts after ``seconds``, and those open then are finished.  Returns
    the streams finished, the admissions and the stream charges made."""
    end = clock.now_ms() + 3_600_000
    t0 = clock.now_ms()
    done = admitted = charged = 0
    active: list[Stream] = []  # each worker starts its next one at once
    starts = {
        (r, w): t0 + w * stream_ms // workers for r in range(len(lims)) for w in range(workers)
    }
    while clock.now_ms() - t0 < seconds * 1000 or active:
        now = clock.now_ms()
        for (r, w), at in list(starts.items()):
            if at <= now and now - t0 < seconds * 1000:
                n = next(SERIAL)
                led = f"{TAG}:req:{n}"
                call = AdmitCall(
                    led,
                    charges(end, 108),
                    tpm_charged=108,
                    count_refused=False,
                    ledger_ttl_ms=TTL,
                    record_draft=f"draft {n}",
                )
                assert (await lims[r].admit(call)).admitted
                admitted += 1
                active.append(Stream(r, w, led, now))
                del starts[(r, w)]
        for a in list(active):
            lim = lims[a.replica]
            if a.charges < 8 and now >= a.started + (a.charges + 1) * stream_ms // 9:
                a.charges += 1
                res = await lim.charge(
                    a.ledger, a.charges, charges(end, 64)[1:], 64, strict=False, ledger_ttl_ms=TTL
                )
                assert res.granted == 64
                charged += 1
            elif a.charges == 8 and now >= a.started + stream_ms:
                adj = [Adjustment(TPM, -12, end)]
                assert await lim.settle_many([SettleCall(a.ledger, adj, TTL)]) == [True]
                active.remove(a)
                done += 1
                starts[(a.replica, a.worker)] = now
        await settle_background(lims)
        for lim in lims:
            if (now - t0) % 500 == 0:
                lim.sweep()
                await lim.returns.flush()
            await lim.flush_drafts()
        await settle_background(lims)
        clock.advance(0.005)
    return done, admitted, charged


#: request numbers, unique across calls of :func:`streams`
SERIAL = itertools.count()


def replicas(n: int = 2) -> tuple[FakeClock, Counting, list[AllowanceLimiter]]:
    clock = FakeClock()
    store = Counting(clock)
    lims = [AllowanceLimiter(store, AllowanceSettings(), clock=clock) for _ in range(n)]
    return clock, store, lims


async def close(lims: Sequence[AllowanceLimiter]) -> None:
    for lim in lims:
        await lim.close()


async def test_two_replicas_warm_streams_cost_well_under_one_call_each() -> None:
    """The bench's two-processor row on a fake clock: streams of 530 ms, two at a time on
    each replica (~3.8 a second each).  Once warm, every admission and charge is served from
    the allowances, no draft is ever sent (each stream settles within ``draft_flush_ms``), and
    takes plus tranche openings cost about one call per tranche drawn: under 0.7 per stream
    (the rules before issue 35's fix made 1.18 here: drafts 0.26, takes 0.35, openings 0.57).
    The counter stays exact: what the requests used plus what the replicas hold."""
    clock, store, lims = replicas()
    try:
        warm, _, _ = await streams(clock, store, lims, seconds=8, stream_ms=530)
        before = Counter(store.calls)
        local = [(lim.stats.local_admissions, lim.stats.local_charges) for lim in lims]
        done, admitted, charged = await streams(clock, store, lims, seconds=20, stream_ms=530)
        calls = store.calls - before
        assert done > 120
        # served from the allowances, all of them
        assert (
            sum(lim.stats.local_admissions - a for lim, (a, _) in zip(lims, local, strict=True))
            == admitted
        )
        assert (
            sum(lim.stats.local_charges - c for lim, (_, c) in zip(lims, local, strict=True))
            == charged
        )
        assert calls["drafts"] == 0, calls
        per_stream = (calls["allowance"] + calls["tranche"]) / done
        assert per_stream < 0.7, (per_stream, calls)
        assert calls["allowance"] > 0 and calls["tranche"] > 0
        # every finished stream used 108 + 8 x 64 - 12 = 608 tokens; the replicas hold the rest
        held = sum(lim.held().get(TPM, 0) for lim in lims)
        assert (await store.read([TPM]))[0] == held + 608 * (warm + done)
    finally:
        await close(lims)


amounts = st.integers(min_value=0, max_value=10**7)


@given(
    opened=amounts,
    closed=amounts,
    tranche=st.integers(min_value=1, max_value=10**6),
    least=st.integers(min_value=0, max_value=10**6),
)
def test_an_opening_never_leaves_more_than_a_tranche_and_a_half_open(
    opened: int, closed: int, tranche: int, least: int
) -> None:
    """What an opening opens (a tranche where one is due, what brings the others under one
    tranche up to one and a half riding on the same call) keeps the open part, what a SIGKILL
    leaks, within 1.5 tranches, or a tranche and the largest request where that is more."""
    n = to_open(opened, closed, tranche, least)
    assert 0 <= n <= min(closed, tranche)
    due = opened < max(tranche // 2, least, 1)
    if n:
        assert opened + n <= max(tranche + tranche // 2, tranche + max(least, 1) - 1)
    if due and closed:
        assert n == min(closed, tranche)  # a due opening opens a whole tranche, as before
    if not due and opened < tranche and closed:
        assert opened + n == min(opened + closed, tranche + tranche // 2)  # rides along
    if opened >= tranche and not due:
        assert n == 0  # open enough: nothing rides


@given(
    units=amounts,
    want=amounts,
    tranche=st.integers(min_value=1, max_value=10**6),
    closed=amounts,
    opening=st.booleans(),
)
def test_a_take_is_due_under_half_of_what_is_wanted_and_rides_on_an_opening(
    units: int, want: int, tranche: int, closed: int, opening: bool
) -> None:
    """A take comes at the opening that would leave the bucket under half of what it wants
    (that call takes and opens); with tranches left to open and none due it waits for that
    opening unless under a quarter; with none left, under half, as before."""
    closed = min(closed, units)
    due = take_due(units, want, tranche, closed, opening=opening)
    if units * 4 < want or (units * 2 < want and not closed):
        assert due  # short with nothing to open, or far short: never waits
    if units * 2 >= want + 2 * tranche:
        assert not due  # it holds enough for the next opening and more
    if opening:
        assert due == ((units - tranche) * 2 < want)
    elif closed:
        assert due == (units * 4 < want)
    assert tops_up(units, want, 0) == (units < want)


class Drafts:
    """One replica with allowances and drafts on a fake clock: requests admitted from the
    allowance, settled when the test says."""

    def __init__(self, flush_ms: int = 1_000) -> None:
        self.clock = FakeClock()
        self.store = Counting(self.clock)
        self.lim = AllowanceLimiter(
            self.store,
            AllowanceSettings(min_rate=2, draft_flush_ms=flush_ms),
            clock=self.clock,
        )
        self.end = self.clock.now_ms() + 3_600_000
        self.n = 0

    async def admit(self, amount: int = 100) -> str:
        self.n += 1
        led = f"{TAG}:req:d{self.n}"
        call = AdmitCall(
            led,
            charges(self.end, amount),
            tpm_charged=amount,
            count_refused=False,
            ledger_ttl_ms=TTL,
            record_draft=f"draft {self.n}",
        )
        assert (await self.lim.admit(call)).admitted
        await settle_background([self.lim])
        return led

    async def settle(self, led: str) -> None:
        assert await self.lim.settle_many([SettleCall(led, [], TTL)]) == [True]

    async def tick(self, ms: int) -> None:
        """``ms`` of fake time, the draft flusher looking every 10 ms."""
        for _ in range(ms // 10):
            self.clock.advance(0.01)
            await self.lim.flush_drafts()

    async def warm(self) -> None:
        while self.lim.stats.local_admissions < 3:
            await self.settle(await self.admit())
            await self.tick(20)
        self.store.calls.clear()
        self.store.kept.clear()


async def test_requests_settled_within_the_interval_never_cost_a_draft_call() -> None:
    """Requests of 600 ms, always two open at a time, each settled before its own draft
    waited ``draft_flush_ms``: no call, ever (the rule before sent every draft waiting once
    any had waited that long, so overlapping requests kept a call a second going)."""
    d = Drafts()
    try:
        await d.warm()
        a = await d.admit()
        await d.tick(300)
        for _ in range(20):
            b = await d.admit()
            await d.tick(300)
            await d.settle(a)
            a = b
            await d.tick(10)
        assert d.lim.stats.local_admissions > 20
        assert d.store.calls["drafts"] == 0
    finally:
        await d.lim.close()


async def test_a_draft_waits_at_most_the_interval_and_one_call_carries_all_then_waiting() -> None:
    """The loss window stays ``draft_flush_ms``: a request open that long has its draft in
    Redis then (with every draft waiting at that moment, young ones included: at most one
    call a tenant per interval); a drop alone waits for a third of the lease, or rides on the
    next call; the drafts sent with a call and settled soon after do not start a call a
    second of their own."""
    d = Drafts()
    try:
        await d.warm()
        long = await d.admit()
        await d.tick(900)
        young = await d.admit()
        await d.tick(90)
        assert d.store.calls["drafts"] == 0
        await d.tick(20)  # the long one waited 1000 ms
        assert d.store.calls["drafts"] == 1
        assert sorted(d.store.kept[-1]) == sorted([long, young])
        await d.settle(young)  # sent, then settled: a drop
        await d.tick(4_000)
        assert d.store.calls["drafts"] == 1  # the drop alone waits
        await d.tick(1_100)  # a third of the 15 s lease since the drop: it goes
        assert d.store.calls["drafts"] == 2
        assert d.store.kept[-1] == []
        # requests admitted continuously, each open 2.5 s: at most one call a second
        calls = d.store.calls["drafts"]
        open_ = []
        for _ in range(40):
            open_.append(await d.admit())
            if len(open_) > 10:
                await d.settle(open_.pop(0))
            await d.tick(250)
        assert d.store.calls["drafts"] - calls <= 10 + 1
        assert d.store.calls["drafts"] - calls >= 8  # and one a second, while drafts wait
    finally:
        await d.lim.close()


async def test_a_failed_draft_call_goes_again_one_interval_later_with_its_drafts() -> None:
    d = Drafts()
    try:
        await d.warm()
        led = await d.admit()
        d.store.down = True
        await d.tick(1_010)
        assert d.store.calls["drafts"] == 1
        await d.tick(500)
        assert d.store.calls["drafts"] == 1  # not at every look: one interval on
        d.store.down = False
        await d.tick(510)
        assert d.store.calls["drafts"] == 2
        assert d.store.kept[-1] == [led]
    finally:
        await d.lim.close()


async def test_a_take_and_an_opening_in_flight_never_open_more_than_a_tranche_and_a_half() -> None:
    """A take sent while a tranche opening is on its way counts that tranche as open (it opens
    only what brings the open part up to one and a half tranches), and no opening is sent for
    an allowance whose take is on its way (the take opens what it needs): the two together
    never leave more open than the bound a SIGKILL leaks (both at once left 2.5 tranches
    open).  Draws are made on the bucket's state directly, as a local admission does."""
    clock = FakeClock()
    store = Counting(clock)
    lim = AllowanceLimiter(store, AllowanceSettings(), clock=clock)
    end = clock.now_ms() + 3_600_000
    bs = charges(end, 100)[1:]
    now = clock.now_ms()
    for _ in range(10):  # busy: ten calls this second
        lim.taker.observe(bs, now)
    st = lim.book.states[TPM]

    def demand(tokens_a_second: int) -> None:
        st.drawn, st.since_ms = tokens_a_second, clock.now_ms() - 1_000

    def open_part() -> int:
        return st.units - st.closed

    gate = asyncio.Event()
    opener, taker = store.open_tranches, store.take_allowances

    async def slow_open(ledger: str, gen: str, items: list[tuple[str, int]]) -> bool | None:
        await gate.wait()
        return await opener(ledger, gen, items)

    async def slow_take(
        items: list[AllowanceTake], lease: AllowanceLease | None = None
    ) -> list[AllowanceGrant | None]:
        await gate.wait()
        return await taker(items, lease)

    try:
        demand(40_000)  # wants 100,000: a quarter of it a tranche
        lim.taker.refill(bs, now)
        await settle_background([lim])
        tranche = st.tranche
        assert st.units == 100_000 and tranche == 25_000
        assert open_part() == tranche + tranche // 2  # a take opens up to 1.5 tranches
        # drawn to under half a tranche: an opening is sent, and waits
        st.units -= open_part() - tranche // 2 + 1
        store.open_tranches = slow_open  # type: ignore[method-assign]
        lim.tranches.open_ahead([st])
        await asyncio.sleep(0)
        assert st.opening == tranche
        # the demand jumps: a take is due, and is sent while the opening waits
        demand(200_000)
        lim.taker.refill(bs, clock.now_ms())
        assert st.taking
        await asyncio.wait([t for t in lim.book.tasks if not t.done()], timeout=0.2)
        assert not st.taking  # answered (the opening still waits)
        gate.set()
        await settle_background([lim])
        big = st.tranche
        assert big > tranche
        assert open_part() <= big + big // 2, (st, open_part())
        # the other way: a take on its way, and the allowance drawn to where an opening is due
        gate.clear()
        store.open_tranches = opener
        store.take_allowances = slow_take
        st.units -= open_part() - big // 2 + 1
        demand(10**6)
        lim.taker.refill(bs, clock.now_ms())
        assert st.taking and lim.tranches.needs_open(st)
        opens = store.calls["tranche"]
        lim.tranches.open_ahead([st])
        lim.tranches.open_short(charges(end, big)[1:])
        await asyncio.sleep(0)
        assert store.calls["tranche"] == opens and not st.opening  # the take opens it
        gate.set()
        await settle_background([lim])
        assert open_part() <= st.tranche + st.tranche // 2, (st, open_part())
        assert open_part() >= min(st.tranche, st.units)  # and it did open it
    finally:
        gate.set()
        await lim.close()
