"""The Redis limiter: three Lua scripts registered once, a bounded timeout, a circuit breaker.

Works with a single Redis server or Redis Cluster (every key of a call shares the tenant's
hash tag, so each script runs on one slot).  Any Redis failure becomes
:class:`extproc.errors.LimiterUnavailable` within ``timeout_ms``; after a failure the breaker
stays open for ``cooldown_ms`` so a dead Redis costs each request nothing but a fast error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from importlib import resources
from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import RedisCluster

from extproc.clock import Clock, SystemClock
from extproc.core.rules import Adjustment, BucketCharge
from extproc.errors import LimiterUnavailable
from extproc.limiter.base import AdmitResult, ChargeResult

T = TypeVar("T")

_ERRORS = (
    redis.exceptions.RedisError,
    ConnectionError,
    OSError,
    TimeoutError,
    asyncio.TimeoutError,
)


def load_script(name: str) -> str:
    """The text of a packaged ``.lua`` script."""
    return resources.files("extproc.limiter").joinpath(f"lua/{name}.lua").read_text("utf-8")


class RedisLimiter:
    """:class:`extproc.limiter.base.Limiter` over Redis (single server or Cluster)."""

    def __init__(
        self,
        client: Any,
        *,
        timeout_ms: int = 250,
        cooldown_ms: int = 1000,
        clock: Clock | None = None,
    ) -> None:
        self._client = client
        self._timeout = timeout_ms / 1000.0
        self._cooldown = cooldown_ms / 1000.0
        self._clock = clock or SystemClock()
        self._open_until = 0.0
        self.round_trips = 0
        self._admit = client.register_script(load_script("admit"))
        self._charge = client.register_script(load_script("charge"))
        self._settle = client.register_script(load_script("settle"))

    @classmethod
    def from_url(
        cls, url: str, *, timeout_ms: int = 250, cooldown_ms: int = 1000, clock: Clock | None = None
    ) -> RedisLimiter:
        """Connect to ``redis://host:port/db`` or ``redis+cluster://host:port`` (lazily)."""
        t = timeout_ms / 1000.0
        client: Any
        if url.startswith("redis+cluster://"):
            client = RedisCluster.from_url(
                "redis://" + url.removeprefix("redis+cluster://"),
                socket_timeout=t,
                socket_connect_timeout=t,
            )
        else:
            client = aioredis.Redis.from_url(
                url, socket_timeout=t, socket_connect_timeout=t, max_connections=256
            )
        return cls(client, timeout_ms=timeout_ms, cooldown_ms=cooldown_ms, clock=clock)

    @property
    def breaker_open(self) -> bool:
        """True while failing fast after a recent Redis failure."""
        return self._clock.monotonic() < self._open_until

    async def _call(self, what: str, aw: Awaitable[T]) -> T:
        if self.breaker_open:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise LimiterUnavailable("the quota backend (Redis) is unavailable; retry shortly")
        self.round_trips += 1
        try:
            async with asyncio.timeout(self._timeout):
                return await aw
        except _ERRORS as exc:
            self._open_until = self._clock.monotonic() + self._cooldown
            raise LimiterUnavailable(
                f"the quota backend (Redis) did not answer {what} in time: {type(exc).__name__}"
            ) from exc

    async def admit(
        self,
        ledger: str,
        buckets: list[BucketCharge],
        *,
        tpm_charged: int,
        count_refused: bool,
        ledger_ttl_ms: int,
    ) -> AdmitResult:
        """Run ``admit.lua`` over every bucket."""
        args: list[Any] = [ledger_ttl_ms, "1" if count_refused else "0", tpm_charged]
        for b in buckets:
            args += ["r" if b.kind == "rpm" else "t", b.amount, b.limit, b.expire_at_ms]
        res = await self._call(
            "admission", self._admit(keys=[ledger] + [b.key for b in buckets], args=args)
        )
        status = int(res[0])
        return AdmitResult(
            admitted=status == 1,
            duplicate=status == 2,
            values=tuple(int(v) for v in res[1]),
        )

    async def charge(
        self,
        ledger: str,
        seq: int,
        buckets: list[BucketCharge],
        amount: int,
        *,
        strict: bool,
        ledger_ttl_ms: int,
    ) -> ChargeResult:
        """Run ``charge.lua``: a lazy batch or a strict lease."""
        args: list[Any] = [seq, amount, "1" if strict else "0", ledger_ttl_ms]
        for b in buckets:
            args += [b.limit, b.expire_at_ms]
        res = await self._call(
            "a stream charge", self._charge(keys=[ledger] + [b.key for b in buckets], args=args)
        )
        return ChargeResult(
            granted=int(res[0]), exhausted=bool(int(res[1])), values=tuple(int(v) for v in res[2])
        )

    async def settle(
        self, ledger: str, adjustments: list[Adjustment], *, ledger_ttl_ms: int
    ) -> bool:
        """Run ``settle.lua`` once per request."""
        args: list[Any] = [ledger_ttl_ms]
        for a in adjustments:
            args += [a.amount, a.expire_at_ms]
        res = await self._call(
            "settlement", self._settle(keys=[ledger] + [a.key for a in adjustments], args=args)
        )
        return bool(int(res))

    async def read(self, keys: list[str]) -> list[int]:
        """MGET the counters (one slot: all keys share a tenant's hash tag)."""
        if not keys:
            return []
        vals = await self._call("a read", self._client.mget(keys))
        return [int(v) if v is not None else 0 for v in vals]

    async def ping(self) -> bool:
        """PING, bypassing the breaker."""
        try:
            async with asyncio.timeout(self._timeout):
                return bool(await self._client.ping())
        except _ERRORS:
            return False

    async def close(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()
