"""The settlement batcher through a Redis stall (DEBUG SLEEP on a real redis-server): calls time
out, the settlements wait in the backlog and are retried, and each lands exactly once."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable

import pytest
import redis

from extproc.core.rules import Adjustment, BucketCharge
from extproc.limiter.base import AdmitCall, SettleCall
from extproc.limiter.batch import BatchSettings, Outcome, SettlementBatcher
from extproc.limiter.redis import RedisLimiter
from tests.helpers import RedisServer

pytestmark = pytest.mark.faults

TTL = 60_000


def far() -> int:
    return int(time.time() * 1000) + 120_000


async def wait_for(cond: Callable[[], bool], deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def test_settlements_survive_a_stall_and_land_once(own_redis: RedisServer) -> None:
    """Redis sleeps 1.2 s while 200 settlements are submitted: the calls time out, the batcher
    keeps and retries them, and after the stall every ledger is settled once (counter exact,
    each reported once), including those a timed-out call ran after all."""
    lim = RedisLimiter.from_url(own_redis.url, timeout_ms=150)
    t = f"st:{{{uuid.uuid4().hex[:10]}}}"
    leds = []
    for i in range(200):
        led = f"{t}:req:{i}"
        res = await lim.admit(
            AdmitCall(
                led,
                [BucketCharge(f"{t}:tpm", "tpm", 100, 10**12, far())],
                tpm_charged=100,
                count_refused=False,
                ledger_ttl_ms=TTL,
            )
        )
        assert res.admitted
        leds.append(led)
    seen: list[Outcome[SettleCall, bool]] = []
    batcher = SettlementBatcher(
        lim, BatchSettings(tick_s=0.002, max_batch=64, backoff_s=0.05), on_result=seen.append
    )
    stalling = threading.Event()

    def stall() -> None:
        c = redis.Redis(port=own_redis.port, socket_timeout=5)
        stalling.set()
        c.execute_command("DEBUG", "SLEEP", "1.2")
        c.close()

    thread = threading.Thread(target=stall, daemon=True)
    thread.start()
    await wait_for(stalling.is_set, 5.0)
    try:
        for i, led in enumerate(leds):
            batcher.submit(SettleCall(led, [Adjustment(f"{t}:tpm", -30, far())], TTL))
            if i % 20 == 19:
                await asyncio.sleep(0.02)  # requests finishing over time, during the stall
        await wait_for(lambda: batcher.backlog.failures > 0, 5.0)
        assert len(batcher) > 0  # kept while Redis sleeps
        assert await batcher.wait_idle(15.0)
    finally:
        thread.join(10)
        left = await batcher.close(2.0)
        await lim.close()
    assert left == []
    assert sorted(o.item.ledger for o in seen) == sorted(leds)
    r = own_redis.client()
    assert r.get(f"{t}:tpm") == str(70 * 200)
    assert {r.hget(led, "state") for led in leds} == {"settled"}
