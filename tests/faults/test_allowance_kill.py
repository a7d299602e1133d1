"""A replica SIGKILLed while it holds allowances: what it held stays counted as used (Redis
does not know what it drew from them), never more than ``share`` of the room left at each take;
the other replica is refused only that much early; the leak ends with the window.  Ground
truth: the counters in Redis and what the killed process reports it admitted."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import uuid

import orjson
import pytest

from extproc.core.rules import Adjustment, BucketCharge
from extproc.limiter.allowance import AllowanceLimiter, AllowanceSettings
from extproc.limiter.base import SettleCall
from extproc.limiter.redis import RedisLimiter
from tests.helpers import RedisServer

pytestmark = pytest.mark.faults

LIMIT = 100_000
SHARE = 0.1
WINDOW_MS = 8_000  # the counters' expiry: the leak ends with it

# The replica to kill: admits 100-token requests (settled to 60) until it holds an
# allowance and has drawn from it, reports what it admitted and holds, then waits.
REPLICA = """
import asyncio, sys, orjson
from extproc.core.rules import Adjustment, BucketCharge
from extproc.limiter.allowance import AllowanceLimiter, AllowanceSettings
from extproc.limiter.base import SettleCall
from extproc.limiter.redis import RedisLimiter

async def main(url, tag, key, expire, limit, share):
    lim = AllowanceLimiter(
        RedisLimiter.from_url(url, timeout_ms=1000),
        AllowanceSettings(share=share, ttl_ms=60_000, min_rate=2),
    )
    truth = 0
    for n in range(2000):
        bs = [BucketCharge(key, "tpm", 100, limit, expire, refundable=100)]
        led = f"{tag}:req:dead.{n}"
        res = await lim.admit(led, bs, tpm_charged=100, count_refused=False, ledger_ttl_ms=60_000)
        assert res.admitted
        await lim.settle_many([SettleCall(led, [Adjustment(key, -40, expire)], 60_000)])
        truth += 60
        await asyncio.sleep(0)
        if lim.stats.local_admissions >= 20:
            break
    if lim._tasks:  # a take still out: what it grants is held too
        await asyncio.wait(list(lim._tasks))
    held = sum(st.units for st in lim._states.values())
    print(orjson.dumps({"truth": truth, "held": held, "taken": lim.stats.taken}).decode(), flush=True)
    await asyncio.sleep(120)

a = sys.argv
asyncio.run(main(a[1], a[2], a[3], int(a[4]), int(a[5]), float(a[6])))
"""


async def test_sigkilled_replica_leaks_at_most_its_allowance(redis_server: RedisServer) -> None:
    tag = f"aiq:{{kill-{uuid.uuid4().hex[:8]}}}"
    key = f"{tag}:tpm:t:*:60:1"
    expire = int(time.time() * 1000) + WINDOW_MS
    argv = [sys.executable, "-c", REPLICA, redis_server.url, tag, key]
    argv += [str(expire), str(LIMIT), str(SHARE)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout=30)
        report = orjson.loads(line)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    rds = redis_server.client()
    try:
        counter = int(rds.get(key) or 0)
        leaked = counter - report["truth"]
        # what it held when it died, and no more: at most the share of the room at each take
        assert leaked == report["held"] > 0
        assert leaked <= SHARE * LIMIT
        # the surviving replica admits up to the limit less the leak, never past the limit
        inner = RedisLimiter.from_url(redis_server.url, timeout_ms=1000)
        live = AllowanceLimiter(inner, AllowanceSettings(share=SHARE, min_rate=2))
        try:
            admitted = 0
            for n in range(LIMIT // 100 + 10):
                bs = [BucketCharge(key, "tpm", 100, LIMIT, expire, refundable=100)]
                led = f"{tag}:req:live.{n}"
                res = await live.admit(
                    led, bs, tpm_charged=100, count_refused=False, ledger_ttl_ms=60_000
                )
                if not res.admitted:
                    continue
                admitted += 100
                await live.settle_many([SettleCall(led, [Adjustment(key, 0, expire)], 60_000)])
                await asyncio.sleep(0)
            await live.give_back()
            assert int(rds.get(key) or 0) <= LIMIT
            assert report["truth"] + admitted + leaked > LIMIT - 100
        finally:
            await live.close()
        # the leak ends with the window: the counter expires (waited on, bounded)
        deadline = time.monotonic() + WINDOW_MS / 1000 + 10
        while rds.exists(key):
            assert time.monotonic() < deadline, "the dead replica's allowance never expired"
            await asyncio.sleep(0.1)
    finally:
        rds.close()
