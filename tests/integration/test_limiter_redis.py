"""The Lua scripts against a real redis-server: atomic admission, stream charges, settlement."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from extproc.clock import FakeClock
from extproc.core.rules import Adjustment, BucketCharge
from extproc.errors import LimiterUnavailable
from extproc.limiter.redis import RedisLimiter
from extproc.stack import free_port
from tests.helpers import RedisServer

pytestmark = pytest.mark.integration

TTL = 60_000


def far() -> int:
    return int(time.time() * 1000) + 120_000


def uniq(prefix: str) -> str:
    return f"t:{{{prefix}-{uuid.uuid4().hex[:8]}}}"


@pytest.fixture
async def limiter(redis_server: RedisServer):  # type: ignore[no-untyped-def]
    lim = RedisLimiter.from_url(redis_server.url, timeout_ms=1000)
    yield lim
    await lim.close()


def buckets(tag: str, rpm_limit: int, tpm_limit: int, amount: int) -> list[BucketCharge]:
    return [
        BucketCharge(f"{tag}:rpm", "rpm", 1, rpm_limit, far()),
        BucketCharge(f"{tag}:tpm", "tpm", amount, tpm_limit, far()),
    ]


async def test_admission_charges_every_bucket(
    limiter: RedisLimiter, redis_server: RedisServer
) -> None:
    """An admitted request adds 1 to RPM and its cost to TPM, with an expiry on each key."""
    tag = uniq("a")
    res = await limiter.admit(
        f"{tag}:req:1",
        buckets(tag, 5, 100, 40),
        tpm_charged=40,
        count_refused=False,
        ledger_ttl_ms=TTL,
    )
    assert res.admitted and not res.duplicate
    assert res.values == (1, 40)
    r = redis_server.client()
    assert r.get(f"{tag}:tpm") == "40"
    assert 0 < r.pttl(f"{tag}:tpm") <= 120_000
    assert r.hget(f"{tag}:req:1", "state") == "admitted"


async def test_admission_is_all_or_nothing(
    limiter: RedisLimiter, redis_server: RedisServer
) -> None:
    """When one bucket would overflow, no bucket is charged."""
    tag = uniq("b")
    await limiter.admit(
        f"{tag}:req:1",
        buckets(tag, 5, 100, 90),
        tpm_charged=90,
        count_refused=False,
        ledger_ttl_ms=TTL,
    )
    res = await limiter.admit(
        f"{tag}:req:2",
        buckets(tag, 5, 100, 20),
        tpm_charged=20,
        count_refused=False,
        ledger_ttl_ms=TTL,
    )
    assert not res.admitted
    assert res.values == (1, 90)
    r = redis_server.client()
    assert r.get(f"{tag}:rpm") == "1"
    assert r.get(f"{tag}:tpm") == "90"
    assert not r.exists(f"{tag}:req:2")


async def test_refused_requests_count_toward_rpm_when_configured(
    limiter: RedisLimiter, redis_server: RedisServer
) -> None:
    """count_refused adds the refused request to RPM buckets only."""
    tag = uniq("c")
    await limiter.admit(
        f"{tag}:req:1",
        buckets(tag, 5, 100, 100),
        tpm_charged=100,
        count_refused=True,
        ledger_ttl_ms=TTL,
    )
    res = await limiter.admit(
        f"{tag}:req:2",
        buckets(tag, 5, 100, 1),
        tpm_charged=1,
        count_refused=True,
        ledger_ttl_ms=TTL,
    )
    assert not res.admitted
    assert res.values == (2, 100)


async def test_replayed_request_id_is_not_charged_twice(
    limiter: RedisLimiter, redis_server: RedisServer
) -> None:
    """A second admission with the same ledger key is reported as duplicate and costs nothing."""
    tag = uniq("d")
    await limiter.admit(
        f"{tag}:req:1",
        buckets(tag, 5, 100, 30),
        tpm_charged=30,
        count_refused=False,
        ledger_ttl_ms=TTL,
    )
    res = await limiter.admit(
        f"{tag}:req:1",
        buckets(tag, 5, 100, 30),
        tpm_charged=30,
        count_refused=False,
        ledger_ttl_ms=TTL,
    )
    assert res.duplicate and not res.admitted
    assert redis_server.client().get(f"{tag}:tpm") == "30"


async def test_lazy_charge_reports_exhaustion_and_is_idempotent(
    limiter: RedisLimiter, redis_server: RedisServer
) -> None:
    """Lazy charges always apply; a replayed sequence number applies once."""
    tag = uniq("e")
    led = f"{tag}:req:1"
    await limiter.admit(
        led, buckets(tag, 5, 100, 50), tpm_charged=50, count_refused=False, ledger_ttl_ms=TTL
    )
    tpm = [BucketCharge(f"{tag}:tpm", "tpm", 40, 100, far())]
    r1 = await limiter.charge(led, 1, tpm, 40, strict=False, ledger_ttl_ms=TTL)
    assert r1.granted == 40 and not r1.exhausted and r1.values == (90,)
    again = await limiter.charge(led, 1, tpm, 40, strict=False, ledger_ttl_ms=TTL)
    assert again.granted == 40 and again.values == (90,)
    r2 = await limiter.charge(led, 2, tpm, 40, strict=False, ledger_ttl_ms=TTL)
    assert r2.granted == 40 and r2.exhausted and r2.values == (130,)
    stale = await limiter.charge(led, 1, tpm, 40, strict=False, ledger_ttl_ms=TTL)
    assert stale.granted == 0
    assert redis_server.client().get(f"{tag}:tpm") == "130"


async def test_strict_lease_grants_only_the_room_left(
    limiter: RedisLimiter, redis_server: RedisServer
) -> None:
    """A strict lease is cut to what every bucket still has, then nothing."""
    tag = uniq("f")
    led = f"{tag}:req:1"
    await limiter.admit(
        led, buckets(tag, 5, 100, 80), tpm_charged=80, count_refused=False, ledger_ttl_ms=TTL
    )
    tpm = [BucketCharge(f"{tag}:tpm", "tpm", 64, 100, far())]
    r1 = await limiter.charge(led, 1, tpm, 64, strict=True, ledger_ttl_ms=TTL)
    assert r1.granted == 20 and r1.exhausted and r1.values == (100,)
    r2 = await limiter.charge(led, 2, tpm, 64, strict=True, ledger_ttl_ms=TTL)
    assert r2.granted == 0 and r2.exhausted
    assert redis_server.client().get(f"{tag}:tpm") == "100"


async def test_settlement_applies_once(limiter: RedisLimiter, redis_server: RedisServer) -> None:
    """Settlement charges and refunds once; later settles and charges change nothing."""
    tag = uniq("g")
    led = f"{tag}:req:1"
    await limiter.admit(
        led, buckets(tag, 5, 1000, 500), tpm_charged=500, count_refused=False, ledger_ttl_ms=TTL
    )
    adj = [Adjustment(f"{tag}:tpm", -380, far())]
    assert await limiter.settle(led, adj, ledger_ttl_ms=TTL) is True
    assert await limiter.settle(led, adj, ledger_ttl_ms=TTL) is False
    late = await limiter.charge(
        led,
        1,
        [BucketCharge(f"{tag}:tpm", "tpm", 50, 1000, far())],
        50,
        strict=False,
        ledger_ttl_ms=TTL,
    )
    assert late.granted == 0
    r = redis_server.client()
    assert r.get(f"{tag}:tpm") == "120"
    assert r.hget(led, "state") == "settled"


async def test_refund_never_goes_below_zero_nor_revives_expired_windows(
    limiter: RedisLimiter, redis_server: RedisServer
) -> None:
    """A refund larger than the counter stops at zero; a refund to a vanished window is dropped."""
    tag = uniq("h")
    r = redis_server.client()
    r.set(f"{tag}:tpm", 10, px=60_000)
    ok = await limiter.settle(
        f"{tag}:req:1",
        [
            Adjustment(f"{tag}:tpm", -50, far()),
            Adjustment(f"{tag}:gone", -50, far()),
            Adjustment(f"{tag}:new", 7, far()),
        ],
        ledger_ttl_ms=TTL,
    )
    assert ok
    assert r.get(f"{tag}:tpm") == "0"
    assert 0 < r.pttl(f"{tag}:tpm") <= 60_000
    assert not r.exists(f"{tag}:gone")
    assert r.get(f"{tag}:new") == "7"


async def test_read_returns_zero_for_missing_keys(
    limiter: RedisLimiter, redis_server: RedisServer
) -> None:
    """Counters that do not exist read as 0."""
    tag = uniq("i")
    redis_server.client().set(f"{tag}:a", 5)
    assert await limiter.read([f"{tag}:a", f"{tag}:b"]) == [5, 0]


async def test_unreachable_redis_fails_fast_and_breaker_opens() -> None:
    """A dead Redis raises LimiterUnavailable within the timeout; once the failure rate over
    the breaker's minimum number of calls is reached, the breaker skips Redis."""
    clock = FakeClock()
    lim = RedisLimiter.from_url(
        f"redis://127.0.0.1:{free_port()}/0", timeout_ms=200, cooldown_ms=1000, clock=clock
    )
    with pytest.raises(LimiterUnavailable):  # raised, not hung (a hang fails the guard)
        async with asyncio.timeout(10):
            await lim.admit(
                "x:{t}:req:1",
                [BucketCharge("x:{t}:rpm", "rpm", 1, 5, far())],
                tpm_charged=0,
                count_refused=False,
                ledger_ttl_ms=TTL,
            )
    assert not lim.breaker_open  # one failure never opens the breaker
    for _ in range(lim.breaker.settings.min_calls - 1):
        with pytest.raises(LimiterUnavailable):
            await lim.read(["x:{t}:rpm"])
    trips = lim.round_trips
    assert lim.breaker_open
    with pytest.raises(LimiterUnavailable):
        await lim.read(["x:{t}:rpm"])
    assert lim.round_trips == trips
    clock.advance(1.5)
    assert not lim.breaker_open
    await lim.close()
