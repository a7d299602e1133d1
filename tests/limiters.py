"""Limiters for tests: the contract suite's backends (the in-memory limiter, Redis, a Redis
Cluster) each with a probe that sets up and reads the state the scripts keep, and a recording
wrapper around the in-memory limiter for tests of the request path."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from extproc.core.rules import Adjustment, BucketCharge, UnconfirmedCharge
from extproc.errors import LimiterUnavailable
from extproc.limiter.base import AdmitCall, AdmitResult, ChargeResult, Limiter
from extproc.limiter.memory import MemoryLimiter


class Probe(Protocol):
    """A test's own view of a limiter's state (what a Redis test reads with its own client)."""

    async def counter(self, key: str) -> int | None:
        """A counter's value; None when it does not exist."""
        ...

    async def ttl_ms(self, key: str) -> int:
        """PTTL: ms left; -1 without expiry; -2 when the key does not exist."""
        ...

    async def seed_counter(self, key: str, value: int, *, ttl_ms: int | None = None) -> None:
        """Write a counter as another writer would."""
        ...

    async def exists(self, key: str) -> bool:
        """Whether the key exists (any kind)."""
        ...

    async def ledger_state(self, ledger: str) -> str | None:
        """A ledger's state field."""
        ...

    async def ledger_draft(self, ledger: str) -> str | None:
        """The record draft a ledger still holds."""
        ...

    async def score(self, key: str, member: str) -> int | None:
        """A member's score in a sorted set."""
        ...

    async def members(self, key: str) -> int:
        """A sorted set's size."""
        ...

    async def close(self) -> None:
        """Release the probe's connections."""
        ...


class MemoryProbe:
    """The probe of a :class:`MemoryLimiter`: its inspection methods."""

    def __init__(self, limiter: MemoryLimiter) -> None:
        self.limiter = limiter

    async def counter(self, key: str) -> int | None:
        """A counter's value; None when it does not exist."""
        return self.limiter.counter(key)

    async def ttl_ms(self, key: str) -> int:
        """PTTL of the key."""
        return self.limiter.ttl_ms(key)

    async def seed_counter(self, key: str, value: int, *, ttl_ms: int | None = None) -> None:
        """SET the counter."""
        self.limiter.seed_counter(key, value, ttl_ms=ttl_ms)

    async def exists(self, key: str) -> bool:
        """Whether the key exists."""
        return self.limiter.ttl_ms(key) != -2

    async def ledger_state(self, ledger: str) -> str | None:
        """The ledger's state."""
        return self.limiter.ledger_state(ledger)

    async def ledger_draft(self, ledger: str) -> str | None:
        """The ledger's draft."""
        return self.limiter.ledger_draft(ledger)

    async def score(self, key: str, member: str) -> int | None:
        """ZSCORE."""
        return self.limiter.score(key, member)

    async def members(self, key: str) -> int:
        """ZCARD."""
        return self.limiter.members(key)

    async def close(self) -> None:
        """Nothing to release."""


class RedisProbe:
    """The probe of a Redis limiter: a client of its own on the same server or cluster."""

    def __init__(self, client: Redis | RedisCluster) -> None:
        self.client = client

    async def counter(self, key: str) -> int | None:
        """GET."""
        value = await self.client.get(key)
        return None if value is None else int(value)

    async def ttl_ms(self, key: str) -> int:
        """PTTL."""
        return int(await self.client.pttl(key))

    async def seed_counter(self, key: str, value: int, *, ttl_ms: int | None = None) -> None:
        """SET (PX)."""
        await self.client.set(key, value, px=ttl_ms)

    async def exists(self, key: str) -> bool:
        """EXISTS."""
        return bool(await self.client.exists(key))

    async def ledger_state(self, ledger: str) -> str | None:
        """HGET state."""
        return _text(await self.client.hget(ledger, "state"))

    async def ledger_draft(self, ledger: str) -> str | None:
        """HGET rec."""
        return _text(await self.client.hget(ledger, "rec"))

    async def score(self, key: str, member: str) -> int | None:
        """ZSCORE."""
        value = await self.client.zscore(key, member)
        return None if value is None else int(value)

    async def members(self, key: str) -> int:
        """ZCARD."""
        return int(await self.client.zcard(key))

    async def close(self) -> None:
        """Close the client."""
        await self.client.aclose()


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class Backend:
    """One backend of the contract suite: the limiter under test and the test's probe."""

    name: str
    limiter: Limiter
    probe: Probe


class RecordingLimiter:
    """The in-memory limiter behind a wrapper that records every call and can be scripted:
    ``down`` fails every call as an unreachable Redis does, ``refuse`` fills each bucket
    of the next admissions to its limit first (another replica used the quota up), and
    ``delays`` makes stream charges answer after that many event-loop turns (cycled), so
    some answer between chunks and some are still pending when the stream must wait."""

    def __init__(self, inner: MemoryLimiter, *, delays: tuple[int, ...] = (0,)) -> None:
        self.inner = inner
        self.delays = delays
        self.admits: list[list[BucketCharge]] = []
        self.charges: list[int] = []
        self.settles: list[list[Adjustment]] = []
        self.down = False
        self.refuse = False

    def _check(self) -> None:
        if self.down:
            raise LimiterUnavailable("the quota backend is down (scripted)")

    async def admit(self, call: AdmitCall) -> AdmitResult:
        """Record the buckets (and the riders' corrections with the settlements), then admit
        (after filling them when ``refuse``)."""
        self._check()
        self.admits.append(call.buckets)
        self.settles += [c.adjustments for c in call.settlements]
        if self.refuse:
            for b in call.buckets:
                if b.kind != "concurrency":
                    self.inner.seed_counter(b.key, b.limit)
        return await self.inner.admit(call)

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
        """Answer after this charge's delay; record the amount asked for."""
        for _ in range(self.delays[len(self.charges) % len(self.delays)]):
            await asyncio.sleep(0)
        self._check()
        self.charges.append(amount)
        return await self.inner.charge(
            ledger, seq, buckets, amount, strict=strict, ledger_ttl_ms=ledger_ttl_ms
        )

    async def settle(
        self,
        ledger: str,
        adjustments: list[Adjustment],
        *,
        ledger_ttl_ms: int,
        cancel: bool = False,
        unconfirmed: UnconfirmedCharge | None = None,
    ) -> bool:
        """Record the corrections, then settle."""
        self._check()
        self.settles.append(adjustments)
        return await self.inner.settle(
            ledger, adjustments, ledger_ttl_ms=ledger_ttl_ms, cancel=cancel, unconfirmed=unconfirmed
        )

    async def renew(
        self, ledgers: list[str], until_ms: int, *, held: dict[str, list[str]] | None = None
    ) -> None:
        """Renew."""
        self._check()
        await self.inner.renew(ledgers, until_ms, held=held)

    async def leave_queue(self, ledger: str, keys: tuple[str, str, str]) -> bool:
        """Leave a queue."""
        self._check()
        return await self.inner.leave_queue(ledger, keys)

    async def read(self, keys: list[str]) -> list[int]:
        """Read."""
        self._check()
        return await self.inner.read(keys)

    async def count_slots(self, keys: list[str], now_ms: int) -> list[int]:
        """Count slots."""
        self._check()
        return await self.inner.count_slots(keys, now_ms)

    async def count_members(self, keys: list[str]) -> list[int]:
        """Count members."""
        self._check()
        return await self.inner.count_members(keys)

    async def stop_input_shortcut(self, key: str, model: str, entry: str, ttl_ms: int) -> bool:
        """Record a model's stopped input shortcut (shared by the gateways on this limiter)."""
        self._check()
        return await self.inner.stop_input_shortcut(key, model, entry, ttl_ms)

    async def input_stops(self, key: str) -> list[str]:
        """The models stopped under ``key``."""
        self._check()
        return await self.inner.input_stops(key)

    async def ping(self) -> bool:
        """Whether the scripted backend is up."""
        return not self.down

    async def close(self) -> None:
        """Close the inner limiter."""
        await self.inner.close()
