"""A call that finds Redis unavailable waits up to ``failover_wait_s`` (sent again, the same
idempotent call) instead of failing: on a real redis-server stopped and started again on the
same port, and past the bound it fails as before (the plan's failure mode then applies)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import redis

from extproc.core.rules import BucketCharge
from extproc.errors import LimiterUnavailable
from extproc.limiter.base import AdmitCall
from extproc.limiter.redis import RedisLimiter
from tests.helpers import RedisServer, far_ms

pytestmark = pytest.mark.integration


def _bucket(tenant: str, amount: int) -> list[BucketCharge]:
    return [BucketCharge(f"aiq:{{{tenant}}}:tpm", "tpm", amount, 10**9, far_ms())]


async def test_an_admission_waits_out_a_restart_and_is_charged_once(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "r", extra=["--appendonly", "yes", "--appendfsync", "always"])
    lim = RedisLimiter.from_url(server.url, timeout_ms=200, failover_wait_s=5.0)
    try:
        t = "wait1"
        assert (
            await lim.admit(
                AdmitCall(
                    f"aiq:{{{t}}}:req:a",
                    _bucket(t, 10),
                    tpm_charged=10,
                    count_refused=False,
                    ledger_ttl_ms=60_000,
                )
            )
        ).admitted
        server.stop()
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        call = asyncio.ensure_future(
            lim.admit(
                AdmitCall(
                    f"aiq:{{{t}}}:req:b",
                    _bucket(t, 7),
                    tpm_charged=7,
                    count_refused=False,
                    ledger_ttl_ms=60_000,
                )
            )
        )
        await asyncio.sleep(1.0)
        assert not call.done()  # waiting, not failed
        restarted = await loop.run_in_executor(None, server.restart)
        res = await call
        waited = time.monotonic() - started
        assert res.admitted and not res.duplicate
        assert 1.0 <= waited < 1.0 + restarted + 1.0
        assert lim.waited_calls >= 1 and lim.waits_exhausted == 0
        with redis.Redis(port=server.port) as c:
            assert int(c.get(f"aiq:{{{t}}}:tpm") or 0) == 17  # once, nothing lost
    finally:
        await lim.close()
        server.stop()


async def test_past_the_bound_the_call_fails_as_unavailable(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "r")
    lim = RedisLimiter.from_url(server.url, timeout_ms=200, failover_wait_s=0.6)
    try:
        assert await lim.ping()
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        started = time.monotonic()
        with pytest.raises(LimiterUnavailable):
            await lim.read(["aiq:{wait2}:x"])
        took = time.monotonic() - started
        assert 0.35 <= took < 0.6 + 0.5  # waited, within its bound (plus one attempt)
        assert lim.waits_exhausted == 1
    finally:
        await lim.close()


async def test_no_wait_configured_fails_at_once(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "r")
    lim = RedisLimiter.from_url(server.url, timeout_ms=200, failover_wait_s=0.0)
    try:
        assert await lim.ping()
        server.stop()
        started = time.monotonic()
        with pytest.raises(LimiterUnavailable):
            await lim.read(["aiq:{wait3}:x"])
        assert time.monotonic() - started < 0.3
        assert lim.waited_calls == 0
    finally:
        await lim.close()
