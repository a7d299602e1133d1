"""Batched settlement on a real redis-server (and Cluster): many ledgers per script call, each
settled exactly once, and the asyncio batcher in front of it."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from extproc.core.rules import RATE_SCALE, Adjustment, BucketCharge, UnconfirmedCharge
from extproc.limiter.base import AdmitCall, ChargeCall, ChargeResult, SettleCall
from extproc.limiter.batch import BatchSettings, ChargeBatcher, Outcome, SettlementBatcher
from extproc.limiter.caller import MAX_ITEMS_PER_CALL
from extproc.limiter.redis import RedisLimiter
from tests.helpers import RedisServer

pytestmark = pytest.mark.integration

TTL = 60_000


def far() -> int:
    return int(time.time() * 1000) + 120_000


def tenant() -> str:
    return f"sb:{{{uuid.uuid4().hex[:10]}}}"


async def admit(lim: RedisLimiter, t: str, req: str, tokens: int, *, lease: bool = False) -> str:
    """Admit one request of ``tokens`` on the tenant's RPM and TPM buckets; its ledger."""
    led = f"{t}:req:{req}"
    now = int(time.time() * 1000)
    res = await lim.admit(
        AdmitCall(
            led,
            [
                BucketCharge(f"{t}:rpm", "rpm", 1, 10**9, far()),
                BucketCharge(f"{t}:tpm", "tpm", tokens, 10**12, far(), refundable=tokens),
            ],
            tpm_charged=tokens,
            count_refused=False,
            ledger_ttl_ms=TTL,
            now_ms=now,
            lease_until_ms=now + 60_000 if lease else 0,
        )
    )
    assert res.admitted
    return led


def refund(t: str, led: str, amount: int) -> SettleCall:
    return SettleCall(led, [Adjustment(f"{t}:tpm", -amount, far())], TTL)


@pytest.fixture
async def limiter(redis_server: RedisServer) -> AsyncIterator[RedisLimiter]:
    """The Redis limiter on the session's server."""
    lim = RedisLimiter.from_url(redis_server.url, timeout_ms=2000)
    yield lim
    await lim.close()


async def test_one_call_settles_many_tenants_each_once(
    limiter: RedisLimiter, redis_server: RedisServer
) -> None:
    """50 requests of 5 tenants in one call: every correction applied once; the same batch
    again, and a ledger repeated inside a batch, change nothing."""
    tenants = [tenant() for _ in range(5)]
    items = []
    for t in tenants:
        for i in range(10):
            led = await admit(limiter, t, str(i), 100, lease=True)
            items.append(refund(t, led, 30 + i))
    before = limiter.round_trips
    assert await limiter.settle_many(items) == [True] * 50
    assert limiter.round_trips - before == 1
    r = redis_server.client()
    for t in tenants:
        assert r.get(f"{t}:tpm") == str(1000 - sum(30 + i for i in range(10)))
        assert r.zcard(f"{t}:open") == 0
        assert r.hget(f"{t}:req:3", "state") == "settled"
    assert await limiter.settle_many(items) == [False] * 50
    t = tenants[0]
    led = await admit(limiter, t, "twice", 100)
    assert await limiter.settle_many([refund(t, led, 40), refund(t, led, 40)]) == [True, False]
    assert r.get(f"{t}:tpm") == str(1000 - sum(30 + i for i in range(10)) + 60)


async def test_batched_and_single_settlement_agree(
    limiter: RedisLimiter, redis_server: RedisServer
) -> None:
    """A batch mixing a refund, a shortfall charge, a cancel of an admission that never ran,
    a lost stream charge and concurrency slots ends with the same counters as settling one by
    one."""

    async def scenario(batched: bool) -> dict[str, object]:
        t = tenant()
        now = int(time.time() * 1000)
        led_a = await admit(limiter, t, "a", 100, lease=True)
        led_b = await admit(limiter, t, "b", 100)
        led_c = f"{t}:req:c"  # its admission never reached Redis
        led_d = f"{t}:req:d"
        slot = BucketCharge(f"{t}:conc", "concurrency", 1, 5, far())
        res = await limiter.admit(
            AdmitCall(
                led_d,
                [slot, BucketCharge(f"{t}:tpm", "tpm", 50, 10**12, far())],
                tpm_charged=50,
                count_refused=False,
                ledger_ttl_ms=TTL,
                now_ms=now,
                lease_until_ms=now + 60_000,
            )
        )
        assert res.admitted
        tpm = [BucketCharge(f"{t}:tpm", "tpm", 0, 10**12, far())]
        ch = await limiter.charge(led_d, 1, tpm, 20, strict=False, ledger_ttl_ms=TTL)
        assert ch.granted == 20  # ran, but its answer is taken as lost below
        items = [
            refund(t, led_a, 60),
            SettleCall(led_b, [Adjustment(f"{t}:tpm", 25, far())], TTL),
            SettleCall(led_c, [Adjustment(f"{t}:tpm", -100, far())], TTL, cancel=True),
            SettleCall(
                led_d,
                [Adjustment(f"{t}:tpm", 5, far())],
                TTL,
                unconfirmed=UnconfirmedCharge(1, ((f"{t}:tpm", RATE_SCALE),)),
            ),
        ]
        if batched:
            assert await limiter.settle_many(items) == [True] * 4
        else:
            for it in items:
                assert await limiter.settle(
                    it.ledger,
                    it.adjustments,
                    ledger_ttl_ms=it.ledger_ttl_ms,
                    cancel=it.cancel,
                    unconfirmed=it.unconfirmed,
                )
        r = redis_server.client()
        # a late admission of the cancelled request charges nothing
        late = await admit_late(limiter, led_c, t)
        assert not late
        return {
            "tpm": r.get(f"{t}:tpm"),
            "rpm": r.get(f"{t}:rpm"),
            "slots": str(r.zcard(f"{t}:conc")),
            "states": ",".join(str(r.hget(led, "state")) for led in (led_a, led_b, led_c, led_d)),
        }

    one_by_one = await scenario(batched=False)
    batched = await scenario(batched=True)
    assert batched == one_by_one
    # 100 - 60, 100 + 25, cancelled: 0, 50 + 20 - 20 (lost charge taken back) + 5
    assert batched["tpm"] == str(40 + 125 + 55)
    assert batched["slots"] == "0"
    assert batched["states"] == "settled,settled,cancelled,settled"


async def admit_late(lim: RedisLimiter, led: str, t: str) -> bool:
    res = await lim.admit(
        AdmitCall(
            led,
            [BucketCharge(f"{t}:tpm", "tpm", 100, 10**12, far())],
            tpm_charged=100,
            count_refused=False,
            ledger_ttl_ms=TTL,
        )
    )
    return res.admitted


async def test_large_batches_are_split_per_call(
    limiter: RedisLimiter, redis_server: RedisServer
) -> None:
    """More settlements than one script call takes go in several calls, all applied once."""
    t = tenant()
    n = MAX_ITEMS_PER_CALL * 2 + 5
    items = [refund(t, await admit(limiter, t, str(i), 10), 3) for i in range(n)]
    before = limiter.round_trips
    assert await limiter.settle_many(items) == [True] * n
    assert limiter.round_trips - before == 3
    assert redis_server.client().get(f"{t}:tpm") == str(7 * n)


async def test_cluster_batches_group_by_slot(cluster: list[int]) -> None:
    """On Redis Cluster a batch of several tenants runs one call per slot, without CROSSSLOT."""
    lim = RedisLimiter.from_url(f"redis+cluster://127.0.0.1:{cluster[0]}", timeout_ms=2000)
    try:
        tenants = [tenant() for _ in range(6)]
        items = [refund(t, await admit(lim, t, str(i), 100), 10) for t in tenants for i in range(4)]
        before = lim.round_trips
        assert await lim.settle_many(items) == [True] * 24
        assert lim.round_trips - before == 6
        for t in tenants:
            assert await lim.read([f"{t}:tpm"]) == [360]
        assert await lim.settle_many(items) == [False] * 24
    finally:
        await lim.close()


async def test_batcher_settles_concurrent_requests_in_few_calls(
    limiter: RedisLimiter, redis_server: RedisServer
) -> None:
    """300 settlements submitted by concurrent tasks: each reported once as applied, the
    counters exact, in far fewer calls than settlements."""
    t = tenant()
    leds = [await admit(limiter, t, str(i), 100) for i in range(300)]
    seen: list[Outcome[SettleCall, bool]] = []
    batcher = SettlementBatcher(limiter, BatchSettings(tick_s=0.005), on_result=seen.append)

    async def request(led: str) -> None:
        await asyncio.sleep(0)
        batcher.submit(refund(t, led, 40))

    await asyncio.gather(*(request(led) for led in leds))
    assert await batcher.wait_idle(10.0)
    assert sorted(o.item.ledger for o in seen) == sorted(leds)
    assert all(o.result for o in seen)
    assert batcher.calls <= 300 // 16
    assert redis_server.client().get(f"{t}:tpm") == str(60 * 300)
    assert await batcher.close(1.0) == []
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(refund(t, leds[0], 1))


def tpm_bucket(t: str, limit: int, *, prev: bool = False) -> BucketCharge:
    """A per-token bucket; with ``prev``, sliding: half of the previous window still counts."""
    if prev:
        return BucketCharge(
            f"{t}:tpm", "tpm", 0, limit, far(), prev_key=f"{t}:tpm:prev", prev_weight=500_000
        )
    return BucketCharge(f"{t}:tpm", "tpm", 0, limit, far())


async def test_charge_batches_match_single_charges(
    limiter: RedisLimiter, redis_server: RedisServer
) -> None:
    """Lazy and strict charges of several streams (a sliding bucket among them) in one call
    grant what one-by-one calls grant; replaying the batch charges nothing again."""

    async def scenario(batched: bool) -> tuple[list[tuple[int, bool, tuple[int, ...]]], list[str]]:
        t1, t2, t3 = tenant(), tenant(), tenant()
        r = redis_server.client()
        r.set(f"{t3}:tpm:prev", 400)  # 200 of it counts in the sliding window
        leds = [await admit(limiter, t, "s", 10) for t in (t1, t2, t3)]
        items = [
            ChargeCall(leds[0], 1, [tpm_bucket(t1, 10**9)], 64, False, TTL),
            ChargeCall(leds[1], 1, [tpm_bucket(t2, 100)], 64, True, TTL),
            ChargeCall(leds[1], 2, [tpm_bucket(t2, 100)], 64, True, TTL),  # only 26 fit
            ChargeCall(leds[2], 1, [tpm_bucket(t3, 300, prev=True)], 64, False, TTL),
            ChargeCall(leds[2], 2, [tpm_bucket(t3, 300, prev=True)], 64, False, TTL),
        ]
        if batched:
            got = await limiter.charge_many(items)
        else:
            got = [
                await limiter.charge(
                    c.ledger, c.seq, c.buckets, c.amount, strict=c.strict, ledger_ttl_ms=TTL
                )
                for c in items
            ]
        results = [(g.granted, g.exhausted, g.values) for g in got if g is not None]
        assert len(results) == len(items)
        counters = [str(r.get(f"{t}:tpm")) for t in (t1, t2, t3)]
        return results, counters

    one_by_one = await scenario(batched=False)
    batched = await scenario(batched=True)
    assert batched == one_by_one
    grants = [g for g, _, _ in batched[0]]
    assert grants == [64, 64, 26, 64, 64]
    # t1: 10 + 64; t2: 10 + 64 + 26 (strict, full); t3: 10 + 128 (lazy, over 300 with prev)
    assert batched[1] == ["74", "100", "138"]
    assert batched[0][4][1] is True  # 138 + 200 > 300: the lazy stream is cut


async def test_replayed_charge_batch_charges_nothing(
    limiter: RedisLimiter, redis_server: RedisServer
) -> None:
    """The same batch sent twice (a retry after a timeout) adds nothing; each replayed
    charge answers its recorded grant."""
    t = tenant()
    leds = [await admit(limiter, t, str(i), 0) for i in range(20)]
    items = [ChargeCall(led, 1, [tpm_bucket(t, 10**9)], 50, False, TTL) for led in leds]
    first = await limiter.charge_many(items)
    again = await limiter.charge_many(items)
    assert [g.granted for g in first if g] == [50] * 20
    assert [g.granted for g in again if g] == [50] * 20
    assert redis_server.client().get(f"{t}:tpm") == str(50 * 20)


async def test_charge_batcher_reports_every_charge(
    limiter: RedisLimiter, redis_server: RedisServer
) -> None:
    """200 lazy charges of 50 streams submitted concurrently: each answered once through
    on_result, the counter exact, in far fewer calls than charges."""
    t = tenant()
    leds = [await admit(limiter, t, str(i), 0) for i in range(50)]
    seen: list[Outcome[ChargeCall, ChargeResult]] = []
    batcher = ChargeBatcher(limiter, BatchSettings(tick_s=0.005), on_result=seen.append)
    for seq in range(1, 5):
        for led in leds:
            batcher.submit(ChargeCall(led, seq, [tpm_bucket(t, 10**9)], 64, False, TTL))
        await asyncio.sleep(0)
    assert await batcher.wait_idle(10.0)
    assert len(seen) == 200 and all(o.result.granted == 64 for o in seen)
    assert sorted((o.item.ledger, o.item.seq) for o in seen) == sorted(
        (led, s) for s in range(1, 5) for led in leds
    )
    assert batcher.calls <= 200 // 16
    assert redis_server.client().get(f"{t}:tpm") == str(64 * 200)
    await batcher.close(1.0)


async def test_one_streams_charges_apply_in_order_across_calls(
    limiter: RedisLimiter, redis_server: RedisServer
) -> None:
    """150 consecutive charges of one stream span three script calls: they run in order, so
    every one is granted (a later call running first would make the earlier ones replays)."""
    t = tenant()
    led = await admit(limiter, t, "long", 0)
    items = [ChargeCall(led, seq, [tpm_bucket(t, 10**9)], 8, False, TTL) for seq in range(1, 151)]
    before = limiter.round_trips
    got = await limiter.charge_many(items)
    assert limiter.round_trips - before == 3
    assert [g.granted if g else None for g in got] == [8] * 150
    assert redis_server.client().get(f"{t}:tpm") == str(8 * 150)
