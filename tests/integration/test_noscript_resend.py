"""A script lost again while its call is being sent (a SCRIPT FLUSH racing redis-py's reload,
or a second failover to a server that never had it): NOSCRIPT means the script did not run,
so the call is sent again at once and applies exactly once; a server that keeps losing it
fails the call with a clear error, the counters untouched.  A real redis-server; the fault
is a real SCRIPT FLUSH sent right after each reload."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from extproc.core.rules import BucketCharge
from extproc.errors import LimiterUnavailable
from extproc.limiter.base import AdmitCall
from extproc.limiter.breaker import BreakerState
from extproc.limiter.caller import NOSCRIPT_RESENDS
from extproc.limiter.redis import RedisLimiter
from tests.helpers import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[RedisLimiter, Redis]]:
    srv = RedisServer(tmp_path / "r")
    lim = RedisLimiter.from_url(srv.url, timeout_ms=1000)
    admin = Redis(port=srv.port)
    yield lim, admin
    await lim.close()
    await admin.aclose()
    srv.stop()


def _flush_after_loads(lim: RedisLimiter, admin: Redis, times: int) -> list[int]:
    """Make the limiter's client flush every script right after each of its next ``times``
    SCRIPT LOADs (the race a flush or a second failover makes); the loads seen."""
    client: Any = lim.caller.client
    real = client.script_load
    seen = [0]

    async def load_then_flush(script: Any) -> Any:
        sha = await real(script)
        seen[0] += 1
        if seen[0] <= times:
            await admin.script_flush()
        return sha

    client.script_load = load_then_flush
    return seen


def _call(n: int) -> AdmitCall:
    far = int(time.time() * 1000) + 120_000
    key = "aiq:{t}:tpm:x"
    return AdmitCall(
        f"aiq:{{t}}:req:{n}",
        [BucketCharge(key, "tpm", 100, 10**9, far)],
        tpm_charged=100,
        count_refused=False,
        ledger_ttl_ms=60_000,
    )


async def test_a_script_flushed_during_its_reload_is_sent_again_and_applies_once(
    server: tuple[RedisLimiter, Redis],
) -> None:
    lim, admin = server
    await admin.script_flush()
    seen = _flush_after_loads(lim, admin, times=2)  # NOSCRIPT three times in a row
    result = await lim.admit(_call(1))
    assert result.admitted
    assert seen[0] >= 3  # the flushes really hit the call
    assert int(await admin.get("aiq:{t}:tpm:x") or 0) == 100  # applied once
    assert await admin.hget("aiq:{t}:req:1", "state") == b"admitted"


async def test_a_server_that_keeps_losing_the_script_fails_the_call_cleanly(
    server: tuple[RedisLimiter, Redis],
) -> None:
    lim, admin = server
    await admin.script_flush()
    _flush_after_loads(lim, admin, times=1000)
    with pytest.raises(LimiterUnavailable, match="kept losing the script"):
        await lim.admit(_call(2))
    assert await admin.get("aiq:{t}:tpm:x") is None  # nothing ran
    assert await admin.exists("aiq:{t}:req:2") == 0
    assert NOSCRIPT_RESENDS >= 2


async def test_resends_take_no_probe_of_a_half_open_breaker(
    server: tuple[RedisLimiter, Redis],
) -> None:
    """A breaker half-open after an outage (a few probes at a time) meets a new master without
    the scripts: each NOSCRIPT gives its probe back, so the resends get through and the
    breaker is not left with probes that never end."""
    lim, admin = server
    breaker = lim.caller.breaker
    breaker.configure(replace(breaker.settings, open_s=0.0))
    breaker._open()  # the outage's end, without making one
    assert breaker.state is BreakerState.HALF_OPEN
    await admin.script_flush()
    _flush_after_loads(lim, admin, times=2)  # NOSCRIPT three times in a row
    result = await lim.admit(_call(3))
    assert result.admitted
    assert breaker._probes_in_flight == 0  # the one probe recorded, none left
