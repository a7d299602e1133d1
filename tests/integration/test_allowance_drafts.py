"""Usage-record drafts of requests admitted from allowances (extproc/limiter/allowance/drafts.py,
drafts.lua), on a real redis-server and on a three-node Redis Cluster.

A replica that dies with such requests open: their drafts, sent batched to its draft ledger,
come back once its lease has run out, with the tokens they had charged, through the tenant's
next admission (admit.lua's reclaim) or through another replica's allowance take
(allowance.lua's, carried by that replica's next admission); exactly once, and none for the
requests it had settled.  Drafts cost no call per request."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from extproc.core.rules import Adjustment, BucketCharge
from extproc.limiter.allowance import AllowanceLimiter, AllowanceSettings
from extproc.limiter.base import AdmitCall, Reclaimed, SettleCall
from extproc.limiter.redis import RedisLimiter
from tests.helpers import RedisServer

pytestmark = pytest.mark.integration

TTL = 60_000
LEASE_MS = 600


@pytest.fixture(params=["redis", "cluster"])
async def url(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        yield server.url
    else:
        ports: list[int] = request.getfixturevalue("cluster")
        yield f"redis+cluster://127.0.0.1:{ports[0]}"


def buckets(tag: str, amount: int) -> list[BucketCharge]:
    exp = int(time.time() * 1000) + 120_000
    return [
        BucketCharge(f"{tag}:rpm:t:*:60:1", "rpm", 1, 1_000_000, exp),
        BucketCharge(f"{tag}:tpm:t:*:60:1", "tpm", amount, 10_000_000, exp, refundable=amount),
    ]


def settings() -> AllowanceSettings:
    return AllowanceSettings(
        share=0.1, ttl_ms=60_000, min_rate=2, lease_ms=LEASE_MS, draft_flush_ms=50
    )


async def admit(
    lim: AllowanceLimiter | RedisLimiter, ledger: str, tag: str, *, now_ms: int = 0
) -> tuple[Reclaimed, ...]:
    res = await lim.admit(
        AdmitCall(
            ledger,
            buckets(tag, 100),
            tpm_charged=100,
            count_refused=False,
            ledger_ttl_ms=TTL,
            now_ms=now_ms,
            lease_until_ms=now_ms + LEASE_MS if now_ms else 0,
            record_draft=f'{{"ledger": "{ledger}"}}',
        )
    )
    assert res.admitted
    return res.reclaimed


async def settle(lim: AllowanceLimiter | RedisLimiter, ledger: str, tag: str) -> None:
    exp = buckets(tag, 0)[1].expire_at_ms
    adj = [Adjustment(f"{tag}:tpm:t:*:60:1", -40, exp)]
    assert await lim.settle_many([SettleCall(ledger, adj, TTL)]) == [True]


async def dying_replica(url: str, tag: str) -> tuple[AllowanceLimiter, dict[str, int]]:
    """A replica that admits from its allowance, leaves some requests open (one with a local
    stream charge), settles the others (some after their drafts were sent), then dies: its
    background work stops, nothing more is sent.  The open requests' ledgers -> charged."""
    lim = AllowanceLimiter(RedisLimiter.from_url(url, timeout_ms=1000), settings())
    n = 0
    while lim.stats.local_admissions < 3:  # warm: the allowance is taken
        n += 1
        await admit(lim, f"{tag}:req:warm.{n}", tag)
        await settle(lim, f"{tag}:req:warm.{n}", tag)
        for t in list(lim.book.tasks):
            await t
        assert n < 200
    local_before = lim.stats.local_admissions
    opened = [f"{tag}:req:open.{i}" for i in range(8)]
    for led in opened:
        await admit(lim, led, tag)
    assert lim.stats.local_admissions == local_before + len(opened)
    calls = lim.stats.draft_calls
    await lim.flush_drafts(force=True)
    assert lim.stats.draft_calls == calls + 1  # one call for all eight drafts
    assert lim.stats.drafts_sent >= len(opened)
    # a local stream charge of one (its charged figure follows at the next flush)
    res = await lim.charge(opened[0], 1, [buckets(tag, 30)[1]], 30, strict=False, ledger_ttl_ms=TTL)
    assert res.granted == 30
    # two settle after their drafts were sent: the next flush drops them
    for led in opened[6:]:
        await settle(lim, led, tag)
    await lim.flush_drafts(force=True)
    # it dies
    for task in (lim._sweeper, lim._draft_task, *lim.book.tasks):
        if task is not None:
            task.cancel()
    await lim.inner.close()
    return lim, dict.fromkeys(opened[:6], 100) | {opened[0]: 130}


async def test_a_dead_replicas_open_drafts_come_back_once_through_an_admission(url: str) -> None:
    tag = f"aiq:{{dr-{uuid.uuid4().hex[:8]}}}"
    _, open_charged = await dying_replica(url, tag)
    live = RedisLimiter.from_url(url, timeout_ms=1000)  # a replica without allowances
    try:
        got: list[Reclaimed] = []
        deadline = time.monotonic() + LEASE_MS / 1000 + 5
        n = 0
        while len(got) < len(open_charged):
            assert time.monotonic() < deadline, f"only {len(got)} drafts came back"
            n += 1
            now = int(time.time() * 1000)
            reclaimed = await admit(live, f"{tag}:req:live.{n}", tag, now_ms=now)
            got += reclaimed
            await settle(live, f"{tag}:req:live.{n}", tag)
            await asyncio.sleep(0.05)
        assert {r.ledger: r.charged for r in got} == open_charged
        assert len(got) == len(open_charged)  # once each
        assert all(r.draft == f'{{"ledger": "{r.ledger}"}}' for r in got)
        for m in range(5):  # and never again
            now = int(time.time() * 1000)
            reclaimed = await admit(live, f"{tag}:req:again.{m}", tag, now_ms=now)
            assert reclaimed == ()
            await settle(live, f"{tag}:req:again.{m}", tag)
    finally:
        await live.close()


async def test_a_dead_replicas_open_drafts_come_back_through_another_replicas_take(
    url: str,
) -> None:
    """Another replica admitting from its own allowances (no admit.lua call): its takes
    reclaim the dead replica's draft ledger, and its next admission carries the drafts."""
    tag = f"aiq:{{dt-{uuid.uuid4().hex[:8]}}}"
    _, open_charged = await dying_replica(url, tag)
    # short allowances: it takes often (a take reclaims; so does any Redis admission)
    short = dataclasses.replace(settings(), ttl_ms=300)
    live = AllowanceLimiter(RedisLimiter.from_url(url, timeout_ms=1000), short)
    try:
        got: list[Reclaimed] = []
        deadline = time.monotonic() + LEASE_MS / 1000 + 10
        n = 0
        while len(got) < len(open_charged):
            assert time.monotonic() < deadline, f"only {len(got)} drafts came back"
            n += 1
            # now_ms 0: admit.lua reclaims nothing; only the takes do
            reclaimed = await admit(live, f"{tag}:req:live.{n}", tag)
            got += reclaimed
            await settle(live, f"{tag}:req:live.{n}", tag)
            for t in list(live.book.tasks):
                await t
            await asyncio.sleep(0.01)
        assert live.stats.local_admissions > 0
        assert {r.ledger: r.charged for r in got} == open_charged
        assert len(got) == len(open_charged)
    finally:
        await live.close()
