"""Local allowances (extproc/limiter/allowance/): two replicas sharing one tenant's counters,
on a real redis-server and on the in-memory limiter.

Far from the limit an admission costs no Redis call (round trips counted); at the limit strict
mode is never over and the counters come back to the exact truth once the allowances are given
back; buckets allowances do not apply to always go to Redis."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from extproc.core.rules import Adjustment, BucketCharge, UnconfirmedCharge
from extproc.limiter.allowance import AllowanceLimiter, AllowanceSettings
from extproc.limiter.base import AdmitCall, SettleCall
from extproc.limiter.memory import MemoryLimiter
from extproc.limiter.redis import RedisLimiter
from tests.helpers import RedisServer

pytestmark = pytest.mark.integration

TTL = 60_000


@dataclass
class Pair:
    """Two replicas (each an allowance wrapper around its own limiter) over one store, and a
    reader of the shared counters."""

    a: AllowanceLimiter
    b: AllowanceLimiter
    reader: RedisLimiter | MemoryLimiter

    @property
    def round_trips(self) -> int:
        """Calls both replicas made to the shared store (one count when they share one
        in-memory store, whose counter already holds both)."""
        if self.a.inner is self.b.inner:
            return self.a.round_trips
        return self.a.round_trips + self.b.round_trips

    async def value(self, key: str) -> int:
        """A counter's value as every replica and the usage API see it."""
        return (await self.reader.read([key]))[0]


@pytest.fixture(params=["memory", "redis", "cluster"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    """Two replicas with allowances: on one MemoryLimiter, or two Redis limiters (one client
    each) on the session's redis-server, or on a three-node Redis Cluster."""
    settings = AllowanceSettings(share=0.1, ttl_ms=2_000, min_rate=4)
    if request.param == "memory":
        store = MemoryLimiter()
        p = Pair(AllowanceLimiter(store, settings), AllowanceLimiter(store, settings), store)
        yield p
        await p.a.close()
        await p.b.close()  # the store's close releases nothing: closing it twice is harmless
        return
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        url = server.url
    else:
        ports: list[int] = request.getfixturevalue("cluster")
        url = f"redis+cluster://127.0.0.1:{ports[0]}"
    inner = [RedisLimiter.from_url(url, timeout_ms=1000) for _ in range(3)]
    p = Pair(AllowanceLimiter(inner[0], settings), AllowanceLimiter(inner[1], settings), inner[2])
    try:
        yield p
    finally:
        await p.a.close()
        await p.b.close()
        await inner[2].close()


def tenant_keys() -> tuple[str, str, str]:
    """A fresh tenant's hash tag and its RPM and TPM counters (fixed one-minute windows)."""
    tag = f"aiq:{{al-{uuid.uuid4().hex[:8]}}}"
    return tag, f"{tag}:rpm:t:*:60:1", f"{tag}:tpm:t:*:60:1"


def far() -> int:
    """An expiry two minutes from now (unix ms)."""
    return int(time.time() * 1000) + 120_000


def charges(
    rpm: str, tpm: str, amount: int, *, rpm_limit: int, tpm_limit: int
) -> list[BucketCharge]:
    """One request's RPM and TPM buckets."""
    exp = far()
    return [
        BucketCharge(rpm, "rpm", 1, rpm_limit, exp),
        BucketCharge(tpm, "tpm", amount, tpm_limit, exp, refundable=amount),
    ]


async def one_request(
    lim: AllowanceLimiter, tag: str, n: int, bs: list[BucketCharge], used: int
) -> bool:
    """Admit one non-streaming request and settle it to ``used`` tokens (a refund of the
    rest of its reservation), as the gateway does; whether it was admitted."""
    ledger = f"{tag}:req:{n}"
    res = await lim.admit(
        AdmitCall(ledger, bs, tpm_charged=bs[1].amount, count_refused=False, ledger_ttl_ms=TTL)
    )
    if not res.admitted:
        return False
    refund = used - bs[1].amount
    adj = [Adjustment(bs[1].key, refund, bs[1].expire_at_ms)] if refund else []
    done = await lim.settle_many([SettleCall(ledger, adj, TTL)])
    assert done == [True]
    return True


async def test_far_from_the_limit_admissions_skip_redis(pair: Pair) -> None:
    """Two replicas, one tenant far from its limits, 1000 requests: at most 0.1 Redis round
    trips per request (admissions, takes, settlements and give-backs all counted), and once
    the allowances are given back the counters hold exactly what the requests used."""
    tag, rpm, tpm = tenant_keys()
    before = pair.round_trips
    truth = 0
    for n in range(1000):
        lim = pair.a if n % 2 else pair.b
        bs = charges(rpm, tpm, 200, rpm_limit=1_000_000, tpm_limit=100_000_000)
        assert await one_request(lim, tag, n, bs, 120)
        truth += 120
        await asyncio.sleep(0)  # a take in flight answers
    trips = pair.round_trips - before
    assert trips / 1000 <= 0.1, trips
    assert pair.a.stats.local_admissions + pair.b.stats.local_admissions >= 900
    held = await pair.value(tpm)
    assert held >= truth  # allowances held count as used
    await pair.a.give_back()
    await pair.b.give_back()
    assert await pair.value(tpm) == truth
    assert await pair.value(rpm) == 1000


async def test_strict_at_the_limit_never_over(pair: Pair) -> None:
    """Two replicas race one tenant to its TPM limit (random sizes, refunds at settlement):
    the shared counter never passes the limit; given back, it equals what the admitted
    requests used, and a last pass fills the limit to within one request."""
    tag, rpm, tpm = tenant_keys()
    limit = 40_000
    rng = random.Random(7)
    truth = [0]
    refused = [0]

    async def replica(lim: AllowanceLimiter, base: int, attempts: int) -> None:
        for n in range(attempts):
            amount = rng.randint(50, 300)
            bs = charges(rpm, tpm, amount, rpm_limit=1_000_000, tpm_limit=limit)
            used = rng.randint(amount // 2, amount)
            if await one_request(lim, tag, base + n, bs, used):
                truth[0] += used
            else:
                refused[0] += 1
            assert await pair.value(tpm) <= limit
            await asyncio.sleep(0)

    await asyncio.gather(replica(pair.a, 0, 400), replica(pair.b, 10_000, 400))
    assert refused[0] > 0  # the limit was reached
    # most were admitted from allowances, on both replicas
    assert pair.a.stats.local_admissions > 20 and pair.b.stats.local_admissions > 20
    await pair.a.give_back()
    await pair.b.give_back()
    assert await pair.value(tpm) == truth[0] <= limit
    # what the allowances held is back: Redis admits up to the limit again
    await replica(pair.a, 20_000, 200)
    await replica(pair.b, 30_000, 200)
    await pair.a.give_back()
    await pair.b.give_back()
    assert await pair.value(tpm) == truth[0]
    assert limit - 300 < truth[0] <= limit


async def test_near_the_limit_allowances_shrink_to_nothing(pair: Pair) -> None:
    """A tenant whose room left is below what one request asks for, over ``share``, gets no
    allowance: every admission goes to Redis."""
    tag, rpm, tpm = tenant_keys()
    # another writer brought the tenant to limit - 900: 10 % of the room (90) is less than
    # one request (100)
    seed = charges(rpm, tpm, 19_100, rpm_limit=1_000_000, tpm_limit=20_000)
    await pair.reader.admit(
        AdmitCall(
            f"{tag}:req:seed", seed, tpm_charged=19_100, count_refused=False, ledger_ttl_ms=TTL
        )
    )
    lim = pair.a
    trips = lim.round_trips
    for n in range(40):
        bs = charges(rpm, tpm, 100, rpm_limit=1_000_000, tpm_limit=20_000)
        assert await one_request(lim, tag, n, bs, 0)  # all refunded: the room stays
        await asyncio.sleep(0)
    assert await pair.value(tpm) == 19_100
    assert lim.stats.local_admissions == 0
    # a take that found the tenant near its limit stops the next ones (for ``ttl_ms``)
    assert lim.stats.takes <= 4
    # an admission and a settlement each, as without allowances, and those few takes
    assert lim.round_trips - trips <= 2 * 40 + 4


async def test_other_limit_kinds_go_to_redis(pair: Pair) -> None:
    """Concurrency, money budgets, sliding windows, shadow limits and windows longer than
    ``max_window_s`` (an hour: a day, and a calendar month, whose key names no length) take
    no allowance: a request touching one is admitted by Redis, whole, every time."""
    tag, rpm, _ = tenant_keys()
    exp = far()
    others = [
        BucketCharge(f"{tag}:conc:t:*", "concurrency", 1, 1000, exp),
        BucketCharge(f"{tag}:cost.USD:t:*:86400:1", "tpm", 5, 10**12, exp),
        BucketCharge(f"{tag}:tpm.sliding:t:*:60:1", "tpm", 5, 10**9, exp, prev_key=f"{tag}:p"),
        BucketCharge(f"{tag}:tpm.shadow:t:*:60:1", "tpm", 5, 10**9, exp, shadow=True),
        BucketCharge(f"{tag}:tpm:t:*:86400:20000", "tpm", 5, 10**9, exp),
        BucketCharge(f"{tag}:tpm:t:*:0:m202612", "tpm", 5, 10**9, exp),
    ]
    lim = pair.a
    for n, extra in enumerate(others * 10):
        bs = [BucketCharge(rpm, "rpm", 1, 10**6, exp), extra]
        res = await lim.admit(
            AdmitCall(f"{tag}:req:{n}", bs, tpm_charged=5, count_refused=False, ledger_ttl_ms=TTL)
        )
        assert res.admitted
        await lim.settle_many([SettleCall(f"{tag}:req:{n}", [], TTL)])
        await asyncio.sleep(0)
    assert lim.stats.local_admissions == 0
    assert lim.stats.taken == 0


async def test_stream_charges_and_refunds_stay_local(pair: Pair) -> None:
    """A locally admitted stream's charges draw from the allowance, its settlement refunds into
    it; a settlement repeated answers "already settled"; the counter ends exact."""
    tag, rpm, tpm = tenant_keys()
    lim = pair.a
    truth = 0
    for n in range(30):  # warm the bucket up: an allowance is taken
        bs = charges(rpm, tpm, 100, rpm_limit=10**6, tpm_limit=10**8)
        assert await one_request(lim, tag, n, bs, 100)
        truth += 100
        await asyncio.sleep(0)
    bs = charges(rpm, tpm, 100, rpm_limit=10**6, tpm_limit=10**8)
    ledger = f"{tag}:req:stream"
    res = await lim.admit(
        AdmitCall(ledger, bs, tpm_charged=100, count_refused=False, ledger_ttl_ms=TTL)
    )
    assert res.admitted
    trips, background = lim.round_trips, lim.stats.opens + lim.stats.takes
    tok = [BucketCharge(tpm, "tpm", 20, 10**8, bs[1].expire_at_ms)]
    for seq in (1, 2, 3):
        got = await lim.charge(ledger, seq, tok, 20, strict=True, ledger_ttl_ms=TTL)
        assert got.granted == 20 and not got.exhausted
    # 100 admitted + 60 charged; it used 130 in all: 30 go back at settlement
    adj = [Adjustment(tpm, -30, bs[1].expire_at_ms)]
    assert await lim.settle(ledger, adj, ledger_ttl_ms=TTL)
    assert not await lim.settle(ledger, adj, ledger_ttl_ms=TTL)
    # no Redis call for any of it (a take or a tranche opening may run in the background)
    assert lim.round_trips - trips <= lim.stats.opens + lim.stats.takes - background
    truth += 130
    await lim.give_back()
    assert await pair.value(tpm) == truth


async def test_charges_of_a_request_redis_admitted_draw_from_the_allowance(pair: Pair) -> None:
    """A stream Redis admitted (before this replica held an allowance) has its later charges
    drawn from the allowance once one is held: no Redis call each; its settlement goes to its
    ledger in Redis as usual (refunds counted against what was granted, local draws
    included), and a last charge drawn here but unconfirmed to the gateway goes back into the
    allowance, not to Redis.  The counters end exact."""
    tag, rpm, tpm = tenant_keys()
    lim = pair.a
    exp = far()
    streams = [f"{tag}:req:early.{i}" for i in range(2)]
    for led in streams:  # admitted by Redis: nothing held yet
        bs = charges(rpm, tpm, 100, rpm_limit=10**6, tpm_limit=10**8)
        trips = lim.round_trips
        res = await lim.admit(
            AdmitCall(led, bs, tpm_charged=100, count_refused=False, ledger_ttl_ms=TTL)
        )
        assert res.admitted and lim.round_trips > trips
    truth = 0
    for n in range(30):  # then the bucket warms up: an allowance is taken
        bs = charges(rpm, tpm, 100, rpm_limit=10**6, tpm_limit=10**8)
        assert await one_request(lim, tag, n, bs, 100)
        truth += 100
        await asyncio.sleep(0)
    for t in list(lim.book.tasks):
        await t
    assert lim.stats.local_admissions > 0
    tok = [BucketCharge(tpm, "tpm", 20, 10**8, exp)]
    trips, background = lim.round_trips, lim.stats.opens + lim.stats.takes
    local = lim.stats.local_charges
    for led in streams:
        for seq in (1, 2, 3):
            got = await lim.charge(led, seq, tok, 20, strict=False, ledger_ttl_ms=TTL)
            assert got.granted == 20 and not got.exhausted
        # a retry of the last one charges nothing more
        assert (await lim.charge(led, 3, tok, 20, strict=False, ledger_ttl_ms=TTL)).granted == 20
    assert lim.stats.local_charges - local == 6
    assert lim.round_trips - trips <= lim.stats.opens + lim.stats.takes - background
    # the first: 100 admitted + 60 charged, used 130: 30 back (to its ledger in Redis)
    adj = [Adjustment(tpm, -30, exp)]
    assert await lim.settle(streams[0], adj, ledger_ttl_ms=TTL)
    assert not await lim.settle(streams[0], adj, ledger_ttl_ms=TTL)
    # the second: its third charge's answer never reached the gateway (unconfirmed): the
    # corrections count 100 + 40 charged, used 120: 20 back; the third goes back here
    adj = [Adjustment(tpm, -20, exp)]
    unconfirmed = UnconfirmedCharge(3, ((tpm, 1_000_000),))
    assert await lim.settle_many([SettleCall(streams[1], adj, TTL, unconfirmed=unconfirmed)]) == [
        True
    ]
    truth += 130 + 120
    await lim.give_back()
    assert await pair.value(tpm) == truth


async def test_a_take_is_idempotent_and_replayed_after_a_failover(
    redis_server: RedisServer,
) -> None:
    """A take carries a call id: the journalled replay of an answered take grants nothing on
    the master that ran it, and on a master that lost it (a failover) puts back exactly the
    grant, whatever the room, so the units the replica holds stay counted."""
    from redis.asyncio import Redis

    from extproc.limiter.base import AllowanceTake

    lim = RedisLimiter.from_url(redis_server.url, timeout_ms=1000)
    rds = Redis(port=redis_server.port)
    try:
        _, _, tpm = tenant_keys()
        [got] = await lim.take_allowances([AllowanceTake(tpm, 500, 10_000, far(), 100_000)])
        assert got is not None and got[:2] == (500, 500)
        assert lim.failover is not None
        [entry] = [e for e in lim.failover.journal if e.script == "allowance"]
        replay = lim.caller.scripts[
            "allowance"
        ]  # the registered script, as the failover replays it
        await replay(keys=entry.keys, args=entry.args)
        assert int(await rds.get(tpm) or 0) == 500  # ran already: nothing more
        await rds.delete(tpm, entry.keys[0])  # a new master that never saw the take
        await rds.set(tpm, 9_990)  # ... and other replicas' charges since
        await replay(keys=entry.keys, args=entry.args)
        assert int(await rds.get(tpm) or 0) == 9_990 + 500
    finally:
        await rds.aclose()
        await lim.close()


async def test_a_dead_replicas_unopened_tranches_are_reclaimed(pair: Pair) -> None:
    """A replica that stops (no renewal, no give-back: it died) holding allowances: once its
    allowance ledger's lease has run out, the tenant's next admission (admit.lua's reclaim, as
    for a request's ledger) gives the never-opened tranches back to the counter; what it had
    opened and not used stays counted (the stated leak).  Its late give-back, if it ever came,
    refunds nothing twice."""
    tag, rpm, tpm = tenant_keys()
    lease_ms = 600
    settings = AllowanceSettings(share=0.1, ttl_ms=60_000, min_rate=2, lease_ms=lease_ms)
    dead = AllowanceLimiter(pair.a.inner, settings)
    truth = 0
    for n in range(200):
        bs = charges(rpm, tpm, 200, rpm_limit=1_000_000, tpm_limit=10_000_000)
        assert await one_request(dead, tag, n, bs, 120)
        truth += 120
        for t in list(dead.book.tasks):
            await t
        st = dead.book.states.get(tpm)
        if dead.stats.local_admissions >= 10 and st is not None and st.closed > 0:
            break
    st = dead.book.states[tpm]
    closed = sum(s.closed for s in dead.book.states.values() if s.key == tpm)
    opened = st.units - st.closed
    assert closed > 0 and opened >= 0
    # it dies: its background work stops, nothing is given back, nothing renewed
    assert dead._sweeper is not None
    dead._sweeper.cancel()
    for t in list(dead.book.tasks):
        t.cancel()
    held_at_death = await pair.value(tpm)
    assert held_at_death == truth + st.units
    # the lease runs out (waited on by its deadline, bounded); the next admission reclaims
    deadline = time.monotonic() + lease_ms / 1000 + 5
    while True:
        now = int(time.time() * 1000)
        bs = charges(rpm, tpm, 100, rpm_limit=1_000_000, tpm_limit=10_000_000)
        res = await pair.b.admit(
            AdmitCall(
                f"{tag}:req:after.{now}",
                bs,
                tpm_charged=100,
                count_refused=False,
                ledger_ttl_ms=TTL,
                now_ms=now,
            )
        )
        assert res.admitted
        await pair.b.settle_many([SettleCall(f"{tag}:req:after.{now}", [], TTL)])
        truth += 100
        for t in list(pair.b.book.tasks):
            await t
        if pair.b.stats.reclaimed:  # by its admission (admit.lua) or its take (allowance.lua)
            break
        assert time.monotonic() < deadline, "the dead replica's tranches were never reclaimed"
        await asyncio.sleep(0.05)
    rpm_st = dead.book.states.get(rpm)
    assert pair.b.stats.reclaimed == closed + (rpm_st.closed if rpm_st else 0)
    # the leak: what it had opened and not used, no more
    await pair.b.give_back()
    assert await pair.value(tpm) == truth + opened
    assert opened <= 1.5 * st.tranche + 200
