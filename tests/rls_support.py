"""Helpers of the RLS tests: RateLimitRequests, a frozen clock, an in-process ``serve``."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from extproc.app import Running, start
from extproc.clock import FakeClock
from extproc.limiter.base import Limiter
from extproc.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
SEED_DIR = ROOT / "config" / "ratelimit"
MINUTE = 60_000
OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT

#: ``await serve(rls_config, **settings)`` -> (RateLimitService stub, the running server)
Serve = Callable[..., Any]


def fake_clock() -> FakeClock:
    """A fixed instant 1 s into the next minute: every call of a test in one window, and keys
    expiring (window end + slack) after the test is over."""
    real = time.time_ns() // 1_000_000
    return FakeClock((real // MINUTE + 1) * MINUTE + 1_000)


class Server:
    """Starts ``ai-quota serve`` in process (port 0) with an RLS config (and the rules file
    ``config=``, tests/data/config/minimal.yaml unless given; on Redis unless given a
    ``limiter``); stops all at the end."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.started: list[Running] = []
        self.channels: list[grpc.aio.Channel] = []

    async def __call__(
        self,
        rls_config: str | Path,
        *,
        clock: FakeClock | None = None,
        redis_url: str = "",
        limiter: Limiter | None = None,
        **kw: Any,
    ) -> tuple[Any, Running]:
        kw.setdefault("insecure", True)  # the RLS tests are about RLS, not the port's door
        settings = Settings(
            config=str(kw.pop("config", ROOT / "tests" / "data" / "config" / "minimal.yaml")),
            redis_url=redis_url or self.redis_url,
            grpc_address="127.0.0.1:0",
            key_prefix=f"t{uuid.uuid4().hex[:8]}",
            admin_store=False,
            usage_stream="off",
            rls_config=str(rls_config),
            rls_watch_s=0.1,
            **kw,
        )
        running = await start(settings, clock=clock or fake_clock(), limiter=limiter)
        self.started.append(running)
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{running.rls_port or running.port}")
        self.channels.append(ch)
        return rls_pb2_grpc.RateLimitServiceStub(ch), running

    async def close(self) -> None:
        """Close the channels and stop every server."""
        for ch in self.channels:
            await ch.close()
        for r in self.started:
            await r.stop(1.0)


def request(
    domain: str,
    *descriptors: list[tuple[str, str]] | tuple[list[tuple[str, str]], int],
    hits: int = 0,
) -> Any:
    """A RateLimitRequest; a descriptor given as (entries, n) carries its own hits_addend."""
    req = rls_pb2.RateLimitRequest(domain=domain, hits_addend=hits)
    for d in descriptors:
        entries, own = (d, None) if isinstance(d, list) else d
        desc = req.descriptors.add()
        for k, v in entries:
            desc.entries.add(key=k, value=v)
        if own is not None:
            desc.hits_addend.value = own
    return req


def metric(running: Running, name: str, **labels: str) -> float:
    """A sample of the replica's registry (0 when absent)."""
    v = running.gateway.metrics.registry.get_sample_value(name, labels)
    return float(v or 0.0)
