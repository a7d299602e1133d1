"""A slow processor is not a dead Redis: a processor starved of CPU (the event loop blocked, as
when a CPU model server shares its cores or a CPU quota throttles it) gets Redis's answer late
but gets it; a Redis that really does not answer is still detected after the timeout."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import pytest

from extproc.core.rules import BucketCharge
from extproc.errors import LimiterUnavailable
from extproc.limiter.base import AdmitCall
from extproc.limiter.breaker import BreakerState
from extproc.limiter.redis import RedisLimiter
from extproc.limiter.starvation import LoopLag, fair_wait
from tests.helpers import RedisServer

pytestmark = pytest.mark.integration


def _charges(tag: str) -> list[BucketCharge]:
    far = int(time.time() * 1000) + 120_000
    return [BucketCharge(f"t:{{{tag}}}:rpm", "rpm", 1, 1000, far)]


def _starve(seconds: float) -> None:
    """Block the event loop (the process gets no CPU for its coroutines)."""
    time.sleep(seconds)


async def test_answer_arriving_while_the_loop_is_starved_is_taken() -> None:
    """A future resolved while the loop is blocked past the timeout still counts as answered;
    plain asyncio.timeout loses it (the control)."""
    loop = asyncio.get_running_loop()
    lag = LoopLag(interval_s=0.01)

    async def answered_soon() -> str:
        await asyncio.sleep(0.01)
        return "ok"

    loop.call_soon(_starve, 0.3)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await answered_soon()
    loop.call_soon(_starve, 0.3)
    assert await fair_wait(answered_soon(), 0.05, lag, 5.0) == "ok"
    lag.stop()


async def test_no_answer_is_still_a_timeout() -> None:
    """A call that never answers times out (starvation only ever adds the time lost)."""
    lag = LoopLag(interval_s=0.01)
    never: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await fair_wait(never, 0.05, lag, 5.0)
    assert never.cancelled()
    lag.stop()


async def _throttle(stop_s: float) -> None:
    """A CPU far too small for the processor: after every turn of the event loop, it gets no
    CPU for ``stop_s`` (so every answer arrives after the timeout has run out)."""
    while True:
        await asyncio.sleep(0)
        _starve(stop_s)


async def test_throttled_processor_admits_against_a_healthy_redis(
    redis_server: RedisServer,
) -> None:
    """With a 50 ms Redis timeout and the processor losing 100 ms of CPU after every turn of
    its event loop, every admission succeeds, slower: no quota_backend_unavailable while Redis
    is healthy."""
    lim = RedisLimiter.from_url(redis_server.url, timeout_ms=50)
    throttle = asyncio.ensure_future(_throttle(0.1))
    try:
        for _ in range(3):
            tag = uuid.uuid4().hex[:8]
            res = await lim.admit(
                AdmitCall(
                    f"t:{{{tag}}}:ledger",
                    _charges(tag),
                    tpm_charged=0,
                    count_refused=False,
                    ledger_ttl_ms=60_000,
                )
            )
            assert res.admitted
        assert lim.breaker.state is not BreakerState.OPEN
    finally:
        throttle.cancel()
        await lim.close()


async def test_frozen_redis_is_still_unavailable(redis_server: RedisServer) -> None:
    """A Redis that is stopped (SIGSTOP) while the processor runs freely fails the call after
    the timeout (and its stall retry), as before."""
    lim = RedisLimiter.from_url(redis_server.url, timeout_ms=50)
    tag = uuid.uuid4().hex[:8]
    await lim.admit(
        AdmitCall(
            f"t:{{{tag}}}:warm",
            _charges(tag),
            tpm_charged=0,
            count_refused=False,
            ledger_ttl_ms=60_000,
        )
    )
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(LimiterUnavailable):
            await lim.admit(
                AdmitCall(
                    f"t:{{{tag}}}:ledger",
                    _charges(tag),
                    tpm_charged=0,
                    count_refused=False,
                    ledger_ttl_ms=60_000,
                )
            )
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
        await lim.close()
