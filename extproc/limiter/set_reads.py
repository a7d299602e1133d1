"""The Redis limiter's reads of sets, for the usage API: a concurrency limit's live slots and a
team's distinct end users in a window (their number, never their members): one pipelined
command per key, all keys in one slot, through the limiter's caller (its timeout, breaker and
failover)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from extproc.limiter.caller import RedisCaller


class SetReads:
    """Mixed into :class:`extproc.limiter.redis.RedisLimiter` (which sets ``caller``)."""

    caller: RedisCaller

    async def count_slots(self, keys: list[str], now_ms: int) -> list[int]:
        """ZCOUNT of each concurrency set over leases still running."""
        return await self._each(keys, lambda pipe, k: pipe.zcount(k, f"({now_ms}", "+inf"))

    async def count_members(self, keys: list[str]) -> list[int]:
        """SCARD of each set (a team's end users: its organisation's slot)."""
        return await self._each(keys, lambda pipe, k: pipe.scard(k))

    async def _each(self, keys: list[str], op: Callable[[Any, str], object]) -> list[int]:
        if not keys:
            return []
        client = self.caller.client

        async def run() -> Any:
            pipe = client.pipeline(transaction=False)
            for k in keys:
                op(pipe, k)
            return await pipe.execute()

        vals = await self.caller.call("a read", "read", run, slot=self.caller.slot(keys[0]))
        return [int(v) for v in vals]
