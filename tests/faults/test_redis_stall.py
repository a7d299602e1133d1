"""Redis stalls and bursts against the real limiter and a real redis-server (its own, since the
tests freeze it): a short stall is ridden out, a burst queues for connections, a dead Redis
opens the breaker on its failure rate and half-open probes close it when Redis is back."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from extproc.core.rules import BucketCharge
from extproc.errors import LimiterUnavailable
from extproc.limiter.base import AdmitCall
from extproc.limiter.breaker import BreakerSettings, BreakerState
from extproc.limiter.redis import RedisLimiter
from extproc.metrics import Metrics
from tests.helpers import RedisServer

pytestmark = pytest.mark.faults

TTL = 60_000


def far() -> int:
    return int(time.time() * 1000) + 120_000


def tag() -> str:
    return f"f:{{{uuid.uuid4().hex[:10]}}}"


def buckets(t: str, amount: int) -> list[BucketCharge]:
    return [
        BucketCharge(f"{t}:rpm", "rpm", 1, 1_000_000, far()),
        BucketCharge(f"{t}:tpm", "tpm", amount, 1_000_000_000, far()),
    ]


def stall_in_thread(port: int, command: list[str], delay: float) -> threading.Thread:
    """Send a blocking command (DEBUG SLEEP / CLIENT PAUSE) after ``delay`` seconds."""

    def run() -> None:
        time.sleep(delay)
        c = redis.Redis(port=port, socket_timeout=5)
        c.execute_command(*command)
        c.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


async def stalled(port: int, within_s: float = 5.0) -> None:
    """Wait until Redis has stopped answering (a DEBUG SLEEP or CLIENT PAUSE in effect): a PING
    on a fresh connection gets no answer within 20 ms."""
    deadline = time.monotonic() + within_s

    def answers() -> bool:
        c = redis.Redis(
            port=port, socket_timeout=0.02, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
        )
        try:
            c.ping()
            return True
        except redis.TimeoutError:
            return False
        finally:
            c.close()

    while await asyncio.to_thread(answers):
        assert time.monotonic() < deadline, "Redis never stalled"
        await asyncio.sleep(0.002)


async def test_streams_ride_out_a_04s_stall(own_redis: RedisServer) -> None:
    """16 streams charging every 20 ms and new admissions through DEBUG SLEEP 0.4: no call
    fails, the breaker never opens, every charge lands exactly once."""
    metrics = Metrics()
    lim = RedisLimiter.from_url(own_redis.url, timeout_ms=250, metrics=metrics)
    streams = [tag() for _ in range(16)]
    for t in streams:
        res = await lim.admit(
            AdmitCall(
                f"{t}:req", buckets(t, 10), tpm_charged=10, count_refused=False, ledger_ttl_ms=TTL
            )
        )
        assert res.admitted
    failures: list[str] = []
    states: set[BreakerState] = set()
    charged = dict.fromkeys(streams, 10)
    stop_at = time.monotonic() + 1.5

    async def stream(t: str) -> None:
        seq = 0
        while time.monotonic() < stop_at:
            seq += 1
            try:
                await lim.charge(
                    f"{t}:req",
                    seq,
                    buckets(t, 0)[1:],
                    16,
                    strict=False,
                    ledger_ttl_ms=TTL,
                )
                charged[t] += 16
            except LimiterUnavailable as exc:
                failures.append(str(exc))
            states.add(lim.breaker.state)
            await asyncio.sleep(0.02)

    async def admissions() -> None:
        while time.monotonic() < stop_at:
            t = tag()
            try:
                await lim.admit(
                    AdmitCall(
                        f"{t}:req",
                        buckets(t, 5),
                        tpm_charged=5,
                        count_refused=False,
                        ledger_ttl_ms=TTL,
                    )
                )
            except LimiterUnavailable as exc:
                failures.append(str(exc))
            await asyncio.sleep(0.01)

    stall = stall_in_thread(own_redis.port, ["DEBUG", "SLEEP", "0.4"], 0.3)
    await asyncio.gather(*(stream(t) for t in streams), admissions(), admissions())
    stall.join()
    assert failures == []
    assert states == {BreakerState.CLOSED}
    timeouts = metrics.registry.get_sample_value(
        "aiq_redis_call_seconds_count", {"script": "charge", "outcome": "timeout"}
    )
    assert timeouts and timeouts > 0  # the stall really hit calls in flight
    r = own_redis.client()
    for t in streams:
        assert int(r.get(f"{t}:tpm") or 0) == charged[t]
    await lim.close()


async def test_400_concurrent_calls_queue_for_the_pool(own_redis: RedisServer) -> None:
    """400 concurrent admissions over a 64-connection pool through a 120 ms CLIENT PAUSE all
    succeed: the burst waits for connections instead of overflowing the pool.  (The bound is
    1 s here, not the default 250 ms: what is tested is that nothing overflows; how long 400
    queued calls take depends on how busy the machine running the suite is.)"""
    metrics = Metrics()
    lim = RedisLimiter.from_url(own_redis.url, timeout_ms=1000, max_connections=64, metrics=metrics)
    await lim.read([f"{tag()}:x"])  # one connection made before the burst
    stall = stall_in_thread(own_redis.port, ["CLIENT", "PAUSE", "120", "ALL"], 0.0)
    await stalled(own_redis.port)
    tags = [tag() for _ in range(400)]
    results = await asyncio.gather(
        *(
            lim.admit(
                AdmitCall(
                    f"{t}:req", buckets(t, 1), tpm_charged=1, count_refused=False, ledger_ttl_ms=TTL
                )
            )
            for t in tags
        ),
        return_exceptions=True,
    )
    stall.join()
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors == []
    assert lim.pool_in_use() == 0
    assert len(lim.caller.client.connection_pool._available_connections) <= 64
    assert lim.breaker.state is BreakerState.CLOSED
    await lim.close()


async def test_dead_redis_opens_on_rate_and_probes_close_it(own_redis: RedisServer) -> None:
    """Redis killed under load: the breaker opens once the failure rate is reached (not on the
    first failure), fails calls without touching Redis, and closes through half-open probes
    once Redis is back."""
    metrics = Metrics()
    settings = BreakerSettings(min_calls=10, open_s=0.3, probes=2)
    lim = RedisLimiter.from_url(own_redis.url, timeout_ms=250, breaker=settings, metrics=metrics)
    t = tag()
    assert (await lim.read([f"{t}:x"])) == [0]
    os.kill(own_redis.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(LimiterUnavailable):
            await lim.read([f"{t}:x"])  # alone: two timed-out attempts, the breaker stays closed
        assert lim.breaker.state is BreakerState.CLOSED
        results = await asyncio.gather(
            *(lim.read([f"{t}:x"]) for _ in range(10)), return_exceptions=True
        )
        assert all(isinstance(r, LimiterUnavailable) for r in results)
        assert BreakerState(lim.breaker.state) is BreakerState.OPEN  # read again after the calls
        assert metrics.registry.get_sample_value("aiq_breaker_state") == 2
        trips = lim.round_trips
        with pytest.raises(LimiterUnavailable):
            await lim.read([f"{t}:x"])
        assert lim.round_trips == trips
    finally:
        os.kill(own_redis.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 5
    # (BreakerState(...): a fresh read, mypy would keep the narrowing of the assert above)
    while BreakerState(lim.breaker.state) is BreakerState.OPEN:  # until its open_s has passed
        assert time.monotonic() < deadline, "the breaker never left OPEN"
        await asyncio.sleep(0.01)
    assert BreakerState(lim.breaker.state) is BreakerState.HALF_OPEN
    assert await lim.read([f"{t}:x"]) == [0]
    assert await lim.read([f"{t}:x"]) == [0]
    assert lim.breaker.state is BreakerState.CLOSED
    assert metrics.registry.get_sample_value("aiq_breaker_state") == 0
    await lim.close()


async def test_configure_changes_the_timeout_of_a_live_limiter(own_redis: RedisServer) -> None:
    """A reload's timeout applies to the next call: with 2 s, a 0.6 s stall is ridden out in
    one attempt."""
    lim = RedisLimiter.from_url(own_redis.url, timeout_ms=100)
    lim.stall_retries = 0
    t = tag()
    await lim.read([f"{t}:x"])
    stall = stall_in_thread(own_redis.port, ["DEBUG", "SLEEP", "0.6"], 0.0)
    await stalled(own_redis.port)
    with pytest.raises(LimiterUnavailable):
        await lim.read([f"{t}:x"])
    stall.join()
    lim.configure(timeout_ms=2000)
    assert lim.timeout_ms == 2000
    stall = stall_in_thread(own_redis.port, ["DEBUG", "SLEEP", "0.6"], 0.0)
    await stalled(own_redis.port)
    assert await lim.read([f"{t}:x"]) == [0]
    stall.join()
    await lim.close()


async def test_the_redis_health_name_follows_redis_and_the_service_stays_up(
    own_redis: RedisServer, tmp_path: Path
) -> None:
    """``aiquota.v1.Redis`` turns NOT_SERVING while this replica's Redis does not answer and
    back when it does; the ext_proc service itself stays SERVING throughout (every replica
    shares Redis: the plans' failure_mode decides, not Envoy's health check)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from extproc.app import REDIS_HEALTH, start
    from extproc.settings import Settings
    from tests.integration.test_admin_store import write_rules

    settings = Settings(
        config=str(write_rules(tmp_path)),
        redis_url=own_redis.url,
        grpc_address="127.0.0.1:0",
        usage_stream="off",
        admin_store=False,
        insecure=True,
    )
    running = await start(settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    stub = health_pb2_grpc.HealthStub(channel)

    async def status(name: str) -> str:
        res = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(res.status))

    async def until(name: str, want: str, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while await status(name) != want:
            assert time.monotonic() < deadline, f"{name or 'overall'} never became {want}"
            await asyncio.sleep(0.1)

    try:
        await until("", "SERVING", 10)
        await until(REDIS_HEALTH, "SERVING", 5)
        os.kill(own_redis.proc.pid, signal.SIGSTOP)
        try:
            await until(REDIS_HEALTH, "NOT_SERVING", 10)
            assert await status("") == "SERVING"
            assert await status("envoy.service.ext_proc.v3.ExternalProcessor") == "SERVING"
        finally:
            os.kill(own_redis.proc.pid, signal.SIGCONT)
        await until(REDIS_HEALTH, "SERVING", 10)
    finally:
        await channel.close()
        await running.stop(1.0)
