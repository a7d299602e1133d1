"""Settlements riding on an admission (``admit(..., settlements=...)``): applied first, each
exactly once, whatever the admission decides; on every backend (in memory, Redis, Cluster),
and on Redis only the riders of the admission's Cluster slot."""

from __future__ import annotations

import time
import uuid

import pytest
from redis.crc import key_slot

from extproc.core.rules import RATE_SCALE, Adjustment, BucketCharge, UnconfirmedCharge
from extproc.limiter.base import MAX_RIDERS, AdmitCall, AdmitResult, Limiter, SettleCall
from extproc.limiter.redis import RedisLimiter
from tests.helpers import RedisServer
from tests.limiters import Backend

pytestmark = pytest.mark.integration

TTL = 60_000


def far() -> int:
    """An expiry two minutes from now (unix ms)."""
    return int(time.time() * 1000) + 120_000


def uniq(prefix: str) -> str:
    """A fresh hash-tagged key prefix (one tenant, one Cluster slot)."""
    return f"t:{{{prefix}-{uuid.uuid4().hex[:8]}}}"


async def admit(
    lim: Limiter,
    tag: str,
    req: str,
    tokens: int,
    *,
    limit: int = 100,
    riders: list[SettleCall] | None = None,
    lease: bool = False,
    prev: int = 0,
) -> AdmitResult:
    """Admit ``tokens`` on the tenant's TPM bucket (limit ``limit``; with ``prev``, sliding:
    half of the previous window's ``prev`` counts) carrying ``riders``."""
    now = int(time.time() * 1000)
    bucket = BucketCharge(f"{tag}:tpm", "tpm", tokens, limit, far(), refundable=tokens)
    if prev:
        bucket = BucketCharge(
            f"{tag}:tpm",
            "tpm",
            tokens,
            limit,
            far(),
            refundable=tokens,
            prev_key=f"{tag}:tpm:prev",
            prev_weight=500_000,
        )
    return await lim.admit(
        AdmitCall(
            f"{tag}:req:{req}",
            [BucketCharge(f"{tag}:rpm", "rpm", 1, 10**6, far()), bucket],
            tpm_charged=tokens,
            count_refused=False,
            ledger_ttl_ms=TTL,
            now_ms=now,
            lease_until_ms=now + 60_000 if lease else 0,
            settlements=riders or [],
        )
    )


def refund(tag: str, req: str, amount: int) -> SettleCall:
    """Request ``req``'s settlement giving ``amount`` tokens back."""
    return SettleCall(f"{tag}:req:{req}", [Adjustment(f"{tag}:tpm", -amount, far())], TTL)


async def test_a_rider_refund_makes_room_before_the_decision(backend: Backend) -> None:
    """A full bucket refuses 60 more tokens; the same admission carrying a settlement that
    refunds 60 is admitted, the rider applied once (True), the counters exact."""
    lim, tag = backend.limiter, uniq("room")
    assert (await admit(lim, tag, "a", 100, lease=True)).admitted
    assert not (await admit(lim, tag, "b", 60)).admitted
    res = await admit(lim, tag, "c", 60, riders=[refund(tag, "a", 60)])
    assert res.admitted and res.settled == (True,)
    assert res.values == (2, 100)  # rpm: a and c (a refusal is not counted here)
    assert await backend.probe.counter(f"{tag}:tpm") == 100
    assert await backend.probe.ledger_state(f"{tag}:req:a") == "settled"
    assert await backend.probe.members(f"{tag}:open") == 0


async def test_a_rider_already_settled_answers_false(backend: Backend) -> None:
    """A settlement that rode once (or was settled by settle()) answers False when it rides
    again, and changes nothing."""
    lim, tag = backend.limiter, uniq("dup")
    for req in ("a", "b"):
        assert (await admit(lim, tag, req, 50)).admitted
    r1 = await admit(lim, tag, "c", 0, riders=[refund(tag, "a", 20)])
    assert r1.settled == (True,)
    assert await lim.settle(
        f"{tag}:req:b", [Adjustment(f"{tag}:tpm", -5, far())], ledger_ttl_ms=TTL
    )
    r2 = await admit(lim, tag, "d", 0, riders=[refund(tag, "a", 20), refund(tag, "b", 5)])
    assert r2.settled == (False, False)
    assert await backend.probe.counter(f"{tag}:tpm") == 75


async def test_riders_settle_even_when_the_admission_is_refused(backend: Backend) -> None:
    """Riders are applied even though the admission they ride on is refused (their refund was
    not enough)."""
    lim, tag = backend.limiter, uniq("refused")
    assert (await admit(lim, tag, "a", 100)).admitted
    res = await admit(lim, tag, "b", 60, riders=[refund(tag, "a", 10)])
    assert not res.admitted and not res.duplicate
    assert res.settled == (True,)
    assert await backend.probe.counter(f"{tag}:tpm") == 90
    assert await backend.probe.ledger_state(f"{tag}:req:b") is None


async def test_riders_of_a_duplicate_request_id_still_settle(backend: Backend) -> None:
    """An admission that finds its ledger (a replay) charges nothing, but its riders apply."""
    lim, tag = backend.limiter, uniq("replay")
    assert (await admit(lim, tag, "a", 40)).admitted
    assert (await admit(lim, tag, "b", 30)).admitted
    res = await admit(lim, tag, "b", 30, riders=[refund(tag, "a", 40)])
    assert res.duplicate and not res.admitted
    assert res.settled == (True,)
    assert await backend.probe.counter(f"{tag}:tpm") == 30


async def test_riders_and_a_sliding_bucket_address_their_own_keys(backend: Backend) -> None:
    """With riders in front of its keys, a sliding admission still reads its previous window
    (half of 80 counts): 20 + 40 + 40 fits 100 only after the rider's refund of 30."""
    lim, tag = backend.limiter, uniq("slide")
    await backend.probe.seed_counter(f"{tag}:tpm:prev", 80, ttl_ms=120_000)
    assert (await admit(lim, tag, "a", 50, prev=80)).admitted
    riders = [refund(tag, "a", 30), refund(tag, "zz", 0)]  # zz was never admitted
    res = await admit(lim, tag, "b", 40, prev=80, riders=riders)
    assert res.admitted and res.settled == (True, True)
    assert res.values[1] == 20 + 40 + 40
    assert not (await admit(lim, tag, "c", 1, prev=80)).admitted


async def test_riders_and_batched_settlement_agree(backend: Backend) -> None:
    """A refund, a shortfall, a cancel of an admission that never ran, a lost stream charge and
    a concurrency slot: riding on an admission ends with the same counters as settle_many."""

    async def scenario(ride: bool) -> tuple[int | None, int, tuple[str | None, ...]]:
        lim, tag = backend.limiter, uniq("agree")
        now = int(time.time() * 1000)
        assert (await admit(lim, tag, "a", 100, limit=10**9, lease=True)).admitted
        assert (await admit(lim, tag, "b", 100, limit=10**9)).admitted
        slot = BucketCharge(f"{tag}:conc", "concurrency", 1, 5, far())
        tpm = BucketCharge(f"{tag}:tpm", "tpm", 50, 10**9, far())
        res = await lim.admit(
            AdmitCall(
                f"{tag}:req:d",
                [slot, tpm],
                tpm_charged=50,
                count_refused=False,
                ledger_ttl_ms=TTL,
                now_ms=now,
                lease_until_ms=now + 60_000,
            )
        )
        assert res.admitted
        charge = [BucketCharge(f"{tag}:tpm", "tpm", 0, 10**9, far())]
        assert (
            await lim.charge(f"{tag}:req:d", 1, charge, 20, strict=False, ledger_ttl_ms=TTL)
        ).granted == 20
        items = [
            refund(tag, "a", 60),
            SettleCall(f"{tag}:req:b", [Adjustment(f"{tag}:tpm", 25, far())], TTL),
            SettleCall(f"{tag}:req:c", [Adjustment(f"{tag}:tpm", -100, far())], TTL, cancel=True),
            SettleCall(
                f"{tag}:req:d",
                [Adjustment(f"{tag}:tpm", 5, far())],
                TTL,
                unconfirmed=UnconfirmedCharge(1, ((f"{tag}:tpm", RATE_SCALE),)),
            ),
        ]
        if ride:
            carrier = await admit(lim, tag, "e", 0, limit=10**9, riders=items)
            assert carrier.admitted and carrier.settled == (True,) * 4
        else:
            settle_many = getattr(lim, "settle_many")  # noqa: B009 - not on the protocol
            assert await settle_many(items) == [True] * 4
        states = tuple([await backend.probe.ledger_state(f"{tag}:req:{r}") for r in "abcd"])
        return (
            await backend.probe.counter(f"{tag}:tpm"),
            await backend.probe.members(f"{tag}:conc"),
            states,
        )

    batched = await scenario(ride=False)
    riding = await scenario(ride=True)
    assert riding == batched
    assert riding == (40 + 125 + 55, 0, ("settled", "settled", "cancelled", "settled"))


async def test_redis_caps_riders_per_admission(lim: RedisLimiter) -> None:
    """More than MAX_RIDERS settlements on one admission is refused before any call."""
    tag = uniq("cap")
    before = lim.round_trips
    with pytest.raises(ValueError, match="at most"):
        await admit(
            lim, tag, "x", 1, riders=[refund(tag, str(i), 1) for i in range(MAX_RIDERS + 1)]
        )
    assert lim.round_trips == before
    many = [refund(tag, str(i), 1) for i in range(MAX_RIDERS)]
    for i in range(MAX_RIDERS):
        assert (await admit(lim, tag, str(i), 2, limit=10**6)).admitted
    res = await admit(lim, tag, "x", 1, limit=10**6, riders=many)
    assert res.admitted and res.settled == (True,) * MAX_RIDERS


async def test_cluster_riders_are_those_of_the_admissions_slot(cluster: list[int]) -> None:
    """On Cluster, rides_with accepts only ledgers of the admission's slot, and an admission
    carrying them runs in one call (no CROSSSLOT); on a single server any ledger rides."""
    lim = RedisLimiter.from_url(f"redis+cluster://127.0.0.1:{cluster[0]}", timeout_ms=2000)
    try:
        tag = uniq("slot")
        other = uniq("slot")
        while key_slot(other.encode()) == key_slot(tag.encode()):
            other = uniq("slot")
        fits = lim.rides_with(f"{tag}:req:new")
        assert fits(f"{tag}:req:old")
        assert not fits(f"{other}:req:old")
        for req in ("a", "b"):
            assert (await admit(lim, tag, req, 30)).admitted
        before = lim.round_trips
        res = await admit(lim, tag, "c", 10, riders=[refund(tag, "a", 30), refund(tag, "b", 30)])
        assert res.admitted and res.settled == (True, True)
        assert lim.round_trips - before == 1
        assert await lim.read([f"{tag}:tpm"]) == [10]
    finally:
        await lim.close()


async def test_single_server_any_ledger_rides(redis_server: RedisServer) -> None:
    """On one server (no slots) every settlement may ride on any admission, other tenants'
    included, each applied on its own keys."""
    lim = RedisLimiter.from_url(redis_server.url, timeout_ms=2000)
    try:
        a, b = uniq("one"), uniq("two")
        assert lim.rides_with(f"{a}:req:x")(f"{b}:req:y")
        assert (await admit(lim, b, "y", 70)).admitted
        res = await admit(lim, a, "x", 5, riders=[refund(b, "y", 70)])
        assert res.admitted and res.settled == (True,)
        assert await lim.read([f"{a}:tpm", f"{b}:tpm"]) == [5, 0]
    finally:
        await lim.close()
