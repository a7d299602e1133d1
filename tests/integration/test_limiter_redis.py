"""What only the Redis limiter has: a bounded failure when Redis is unreachable, and the
circuit breaker (the scripts' contract is in ``test_limiter_contract.py``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from extproc.clock import FakeClock
from extproc.core.rules import BucketCharge
from extproc.errors import LimiterUnavailable
from extproc.limiter.base import AdmitCall
from extproc.limiter.breaker import BreakerState
from extproc.limiter.redis import RedisLimiter
from extproc.stack import free_port

pytestmark = pytest.mark.integration

TTL = 60_000


def _open(lim: RedisLimiter) -> bool:
    """The breaker fails calls fast."""
    return lim.breaker.state is BreakerState.OPEN


def far() -> int:
    """An expiry two minutes from now (unix ms)."""
    return int(time.time() * 1000) + 120_000


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
                AdmitCall(
                    "x:{t}:req:1",
                    [BucketCharge("x:{t}:rpm", "rpm", 1, 5, far())],
                    tpm_charged=0,
                    count_refused=False,
                    ledger_ttl_ms=TTL,
                )
            )
    assert not _open(lim)  # one failure never opens the breaker
    for _ in range(lim.breaker.settings.min_calls - 1):
        with pytest.raises(LimiterUnavailable):
            await lim.read(["x:{t}:rpm"])
    trips = lim.round_trips
    assert _open(lim)
    with pytest.raises(LimiterUnavailable):
        await lim.read(["x:{t}:rpm"])
    assert lim.round_trips == trips
    clock.advance(1.5)
    assert not _open(lim)
    await lim.close()
