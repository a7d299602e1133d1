"""Never counted twice: Redis stalled past the limiter's timeout by a busy Lua script (another
client's EVAL spinning 0.7 s: the commands sent meanwhile queue, and Redis runs them once it
wakes, although their callers gave up), for every script the limiter sends.  The stall retry
sends each call a second time; each carries its idempotency key (ledger and sequence number,
or the RLS call id), so what lands is exactly what was meant, once.  And redis-py's own retry
(10 re-sends by default in redis-py 8) is off for every client the gateway makes."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from extproc.core.rules import Adjustment, BucketCharge
from extproc.errors import LimiterUnavailable
from extproc.limiter.base import AdmitCall
from extproc.limiter.redis import RedisLimiter
from extproc.limiter.redis_url import async_client
from extproc.limiter.rls_counter import RedisRlsCounter
from tests.helpers import RedisServer

pytestmark = pytest.mark.faults

TTL = 60_000
STALL_US = 700_000
#: A script that keeps Redis busy for STALL_US microseconds (other clients' commands queue).
BUSY = (
    "local t = redis.call('TIME') local s = t[1] * 1000000 + t[2] "
    "while true do local n = redis.call('TIME') "
    f"if n[1] * 1000000 + n[2] - s > {STALL_US} then break end end return 1"
)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()


def far() -> int:
    return int(time.time() * 1000) + 120_000


def tag() -> str:
    return f"once:{{{uuid.uuid4().hex[:10]}}}"


def busy(port: int) -> threading.Thread:
    def run() -> None:
        with redis.Redis(port=port, socket_timeout=5) as c:
            c.eval(BUSY, 0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def wait_busy(port: int) -> None:
    """Until a PING on a fresh connection goes unanswered for 50 ms."""
    import socket

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            sock.settimeout(0.05)
            try:
                sock.recv(16)
            except TimeoutError:
                return
    pytest.fail("Redis never became busy")


async def stalled(port: int, call: Callable[[], Awaitable[Any]]) -> BaseException | None:
    """Run ``call`` while Redis is busy; wait until Redis answers again; what ``call`` raised."""
    thread = busy(port)
    await asyncio.to_thread(wait_busy, port)
    try:
        await call()
        outcome: BaseException | None = None
    except LimiterUnavailable as exc:
        outcome = exc
    await asyncio.to_thread(thread.join, 5)
    with redis.Redis(port=port) as c:
        c.ping()  # every queued command has run
    return outcome


async def warm(lim: RedisLimiter) -> None:
    """Load every script (a first EVALSHA would otherwise fail with NOSCRIPT, then reload)."""
    t = tag()
    b = [BucketCharge(f"{t}:tpm", "tpm", 1, 1_000_000, far())]
    await lim.admit(AdmitCall(f"{t}:r", b, tpm_charged=1, count_refused=False, ledger_ttl_ms=TTL))
    await lim.charge(f"{t}:r", 1, b, 1, strict=False, ledger_ttl_ms=TTL)
    await lim.settle(f"{t}:r", [], ledger_ttl_ms=TTL)
    await RedisRlsCounter(lim.caller).rls_check([(f"{t}:rls", 1, 10, far(), 1)])


async def test_each_script_counts_once_through_a_stall(own_redis: RedisServer) -> None:
    """timeout 200 ms, stall 0.7 s: both attempts time out and the caller gets
    LimiterUnavailable; Redis, once awake, may run what was sent.  The caller then sends the
    same call again (as the batcher, the settlement backlog and the cancel settlement do):
    every script ends up applied exactly once."""
    from extproc.limiter.base import ChargeCall, SettleCall

    lim = RedisLimiter.from_url(own_redis.url, timeout_ms=200)
    r = own_redis.client()
    try:
        await warm(lim)
        t = tag()
        led = f"{t}:req"
        tpm = BucketCharge(f"{t}:tpm", "tpm", 100, 1_000_000, far())
        out = BucketCharge(f"{t}:tpm", "tpm", 0, 1_000_000, far())
        calls: list[tuple[Callable[[], Awaitable[Any]], str]] = [
            (
                lambda: lim.admit(
                    AdmitCall(led, [tpm], tpm_charged=100, count_refused=False, ledger_ttl_ms=TTL)
                ),
                "100",
            ),
            (lambda: lim.charge(led, 1, [out], 50, strict=False, ledger_ttl_ms=TTL), "150"),
            (lambda: lim.charge(led, 2, [out], 50, strict=True, ledger_ttl_ms=TTL), "200"),
            (lambda: lim.charge_many([ChargeCall(led, 3, [out], 10, False, TTL)]), "210"),
            (
                lambda: lim.settle(led, [Adjustment(f"{t}:tpm", -30, far())], ledger_ttl_ms=TTL),
                "180",
            ),
        ]
        led2 = f"{t}:req2"
        calls.append(
            (
                lambda: lim.admit(
                    AdmitCall(led2, [tpm], tpm_charged=100, count_refused=False, ledger_ttl_ms=TTL)
                ),
                "280",
            )
        )
        calls.append(
            (
                lambda: lim.settle_many(
                    [SettleCall(led2, [Adjustment(f"{t}:tpm", 5, far())], TTL)]
                ),
                "285",
            )
        )
        for call, expect in calls:
            await stalled(own_redis.port, call)
            await call()  # the caller's own retry, once Redis answers
            assert r.get(f"{t}:tpm") == expect
        # an RLS check of 7 hits: Envoy does not retry it; whatever ran counted once
        rk = f"{t}:rls"
        exc = await stalled(
            own_redis.port, lambda: RedisRlsCounter(lim.caller).rls_check([(rk, 7, 1000, far(), 1)])
        )
        assert isinstance(exc, LimiterUnavailable)
        assert r.get(rk) in (None, "7")
    finally:
        r.close()
        await lim.close()


async def test_a_ridden_out_stall_counts_once(own_redis: RedisServer) -> None:
    """timeout 450 ms, stall 0.7 s: the first attempt times out, the second is answered
    when Redis wakes; the first ran too, and the idempotency keys made the second a no-op:
    every call succeeds, each counted once."""
    lim = RedisLimiter.from_url(own_redis.url, timeout_ms=450)
    r = own_redis.client()
    try:
        await warm(lim)
        t = tag()
        led = f"{t}:req"
        tpm = BucketCharge(f"{t}:tpm", "tpm", 100, 1_000_000, far())
        calls: list[tuple[Callable[[], Awaitable[Any]], str]] = [
            (
                lambda: lim.admit(
                    AdmitCall(led, [tpm], tpm_charged=100, count_refused=False, ledger_ttl_ms=TTL)
                ),
                "100",
            ),
            (lambda: lim.charge(led, 1, [tpm], 40, strict=True, ledger_ttl_ms=TTL), "140"),
            (lambda: lim.charge(led, 2, [tpm], 40, strict=False, ledger_ttl_ms=TTL), "180"),
            (
                lambda: lim.settle(led, [Adjustment(f"{t}:tpm", -80, far())], ledger_ttl_ms=TTL),
                "100",
            ),
        ]
        for call, expect in calls:
            assert await stalled(own_redis.port, call) is None
            assert r.get(f"{t}:tpm") == expect
        ok, before = (None, None)
        rk = f"{t}:rls"

        async def check() -> None:
            nonlocal ok, before
            ok, before = await RedisRlsCounter(lim.caller).rls_check([(rk, 7, 1000, far(), 1)])

        assert await stalled(own_redis.port, check) is None
        assert (ok, before, r.get(rk)) == (True, [0], "7")
        evalsha = r.info("commandstats")["cmdstat_evalsha"]["calls"]
        assert evalsha >= 4 + 2 * 5  # warm-up, then two attempts per stalled call
    finally:
        r.close()
        await lim.close()


async def test_redis_py_never_resends(own_redis: RedisServer) -> None:
    """A client made by the gateway's factory, its socket timing out during the stall: the
    command is not sent again by redis-py (it ran once, when Redis woke)."""
    client = async_client(own_redis.url, timeout_s=0.2)
    key = f"{tag()}:n"
    try:
        await client.ping()
        thread = busy(own_redis.port)
        await asyncio.to_thread(wait_busy, own_redis.port)
        with pytest.raises(redis.exceptions.TimeoutError):
            await client.incrby(key, 100)
        await asyncio.to_thread(thread.join, 5)
        assert int(await client.get(key)) == 100
    finally:
        await client.aclose()
