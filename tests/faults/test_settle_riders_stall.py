"""Settlements riding on an admission through a Redis stall (DEBUG SLEEP on a real
redis-server): the admission times out after Redis may have run it, its riders go back to the
batcher, and each settlement still lands exactly once; a drain started meanwhile waits for
them."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable

import pytest
import redis

from extproc.clock import SystemClock
from extproc.config import load_config_text
from extproc.core.rules import Adjustment, BucketCharge
from extproc.errors import LimiterUnavailable
from extproc.gateway import Gateway
from extproc.limiter.base import AdmitCall, AdmitResult, SettleCall
from extproc.limiter.batch import BatchSettings, Outcome
from extproc.limiter.redis import RedisLimiter
from extproc.metrics import Metrics
from tests.helpers import RedisServer

pytestmark = pytest.mark.faults

TTL = 60_000
RULES = """
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 1000}
plans:
  p: {limits: [{model: "*", per: minute, rpm: 1000}]}
tenants:
  t: {plan: p, keys: [{name: k, plaintext: sk-t}]}
"""


def far() -> int:
    """An expiry two minutes from now (unix ms)."""
    return int(time.time() * 1000) + 120_000


async def wait_for(cond: Callable[[], bool], deadline_s: float) -> None:
    """Poll ``cond`` until it holds, or fail after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def stall_thread(port: int, seconds: float) -> tuple[threading.Thread, threading.Event]:
    """A thread that makes Redis sleep ``seconds`` (DEBUG SLEEP), and the event set once the
    command is about to be sent."""
    started = threading.Event()

    def stall() -> None:
        c = redis.Redis(port=port, socket_timeout=10)
        started.set()
        c.execute_command("DEBUG", "SLEEP", str(seconds))
        c.close()

    return threading.Thread(target=stall, daemon=True), started


async def carrying_admission(gw: Gateway, lim: RedisLimiter, led: str) -> AdmitResult | None:
    """An admission (RPM only) carrying what waits, as ``limiter_admit`` does it: the riders
    go back to the gateway whatever happens to the call; None when the call failed."""
    riders = gw.background.riders_for(led)
    done: AdmitResult | None = None
    try:
        done = await lim.admit(
            AdmitCall(
                led,
                [BucketCharge(led.rsplit(":req:", 1)[0] + ":rpm", "rpm", 1, 10**6, far())],
                tpm_charged=0,
                count_refused=False,
                ledger_ttl_ms=TTL,
                settlements=riders,
            )
        )
    except LimiterUnavailable:
        pass
    finally:
        gw.background.riders_done(riders, done)
    return done


async def test_riders_of_a_stalled_admission_land_once(own_redis: RedisServer) -> None:
    """Redis sleeps 1 s while an admission carries 30 settlements: the call times out (Redis
    runs it when it wakes), the riders go back and are retried by the batcher during a drain;
    each settlement is applied once (counter exact, every ledger settled, each reported
    once), and the drain reports nothing lost."""
    lim = RedisLimiter.from_url(own_redis.url, timeout_ms=150)
    gw = Gateway(
        config=load_config_text(RULES),
        limiter=lim,
        clock=SystemClock(),
        metrics=Metrics(),
        batch_settings=BatchSettings(tick_s=3600.0, backoff_s=0.05),
    )
    t = f"rs:{{{uuid.uuid4().hex[:10]}}}"
    leds = []
    for i in range(30):
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
    seen: list[tuple[str, bool]] = []
    batcher = gw.background.settle_batcher
    assert batcher is not None
    counted = batcher.on_result
    assert counted is not None

    def on_result(o: Outcome[SettleCall, bool]) -> None:
        seen.append((o.item.ledger, o.result))
        counted(o)

    batcher.on_result = on_result
    for led in leds:
        gw.background.submit_settlement(SettleCall(led, [Adjustment(f"{t}:tpm", -30, far())], TTL))
    thread, stalling = stall_thread(own_redis.port, 1.0)
    thread.start()
    await wait_for(stalling.is_set, 5.0)
    await asyncio.sleep(0.05)  # the DEBUG SLEEP is running
    try:
        admission = asyncio.ensure_future(carrying_admission(gw, lim, f"{t}:req:carrier"))
        await wait_for(lambda: batcher.backlog.riding == 30, 5.0)
        assert len(batcher) == 30  # riding, still counted: a drain waits for them
        drain = asyncio.ensure_future(gw.background.drain_settlements(10.0))
        assert await admission is None  # timed out (twice): its riders went back
        await drain
    finally:
        thread.join(10)
        await lim.close()
    assert len(batcher) == 0
    assert sorted(led for led, _ in seen) == sorted(leds)  # each reported exactly once
    r = own_redis.client()
    assert r.get(f"{t}:tpm") == str(70 * 30)
    assert {r.hget(led, "state") for led in leds} == {"settled"}
    # whichever call ran first applied each settlement; the others found it settled
    m = gw.metrics
    applied = m.settlements.labels("applied")._value.get()
    duplicates = m.duplicate_hits.labels("settle")._value.get()
    assert applied == sum(1 for _, ok in seen if ok)
    assert applied + duplicates == 30
