"""The in-memory limiter's keyspace: the Lua scripts' data model (counters, sorted sets and
ledgers, each key with an optional expiry in unix ms) and the Redis commands the scripts use
on it, with Redis's expiry rules (an expiry at or before now deletes the key at once, a key is
gone once now is past its expiry, an empty sorted set does not exist).  A key holds one kind
of value; using it as another raises :class:`extproc.errors.LimiterUnavailable` (Redis answers
WRONGTYPE).  :class:`extproc.limiter.memory.MemoryLimiter` runs the scripts' steps on it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from extproc.core.rules import BucketCharge
from extproc.errors import LimiterUnavailable

LedgerState = Literal["admitted", "reclaimed", "settled", "cancelled"]


@dataclass(slots=True)
class Counter:
    """A string counter (INCRBY/DECRBY)."""

    value: int
    expire_at: int | None = None


@dataclass(slots=True)
class Scored:
    """A sorted set: member -> score (concurrency slots, a tenant's open reservations)."""

    members: dict[str, int] = field(default_factory=dict)
    expire_at: int | None = None

    def ordered(self) -> list[tuple[str, int]]:
        """Members by score, then by name (ZRANGEBYSCORE's order)."""
        return sorted(self.members.items(), key=lambda kv: (kv[1], kv[0]))


@dataclass(slots=True)
class Ledger:
    """A request's ledger (the scripts' hash): its state, last stream charge, what it charged,
    the refundable part per counter, its concurrency slots and its record draft."""

    state: LedgerState | None = None
    seq: int = 0
    last_grant: int = 0
    charged: int = 0
    input: int = -1  # the exact input noted (note.lua's "in"), -1: none
    refundable: dict[str, int] = field(default_factory=dict)
    slots: dict[str, None] = field(default_factory=dict)
    draft: str | None = None
    expire_at: int | None = None
    gen: str = ""  # an allowance ledger's generation ("": a request's ledger)


Entry = Counter | Scored | Ledger
_NAMES: dict[type, str] = {Counter: "counter", Scored: "sorted set", Ledger: "ledger"}
E = TypeVar("E", Counter, Scored, Ledger)


class Keyspace:
    """Keys to values; every command is told the time (unix ms) it runs at."""

    def __init__(self) -> None:
        self.data: dict[str, Entry] = {}

    def entry(self, key: str, now: int) -> Entry | None:
        entry = self.data.get(key)
        if entry is not None and entry.expire_at is not None and now > entry.expire_at:
            del self.data[key]
            return None
        return entry

    def typed(self, key: str, kind: type[E], now: int) -> E | None:
        entry = self.entry(key, now)
        if entry is None or isinstance(entry, kind):
            return entry
        raise LimiterUnavailable(
            f"{key} holds a {_NAMES[type(entry)]}, not a {_NAMES[kind]} (a key names one kind)"
        )

    def counter_value(self, key: str, now: int) -> int:
        c = self.typed(key, Counter, now)
        return c.value if c is not None else 0

    def incr(self, key: str, amount: int, now: int) -> int:
        c = self.typed(key, Counter, now)
        if c is None:
            c = self.data[key] = Counter(0)
        c.value += amount
        return c.value

    def expire_at(self, key: str, when: int, now: int) -> None:
        """PEXPIREAT: a time not after now deletes the key; a missing key stays missing."""
        entry = self.entry(key, now)
        if entry is None:
            return
        if when <= now:
            del self.data[key]
        else:
            entry.expire_at = when

    def take(self, key: str, amount: int, now: int) -> None:
        """Refund ``amount`` from a counter that still exists, never below zero (TTL kept)."""
        c = self.typed(key, Counter, now)
        if amount > 0 and c is not None:
            c.value = max(0, c.value - amount)

    def zadd(self, key: str, member: str, score: int, now: int) -> None:
        z = self.typed(key, Scored, now)
        if z is None:
            z = self.data[key] = Scored()
        z.members[member] = score

    def zrem(self, key: str, member: str, now: int) -> None:
        z = self.typed(key, Scored, now)
        if z is not None:
            z.members.pop(member, None)
            if not z.members:
                del self.data[key]

    def ledger(self, key: str, now: int) -> Ledger:
        led = self.typed(key, Ledger, now)
        if led is None:
            led = self.data[key] = Ledger()
        return led

    def windowed(self, key: str, prev_key: str, prev_weight: int, now: int) -> tuple[int, int]:
        """A counter's value and the previous window's share in it (0 for a fixed window),
        rounded as the scripts round it: floor of the product over a million in doubles."""
        prev = 0
        if prev_key:
            before = self.counter_value(prev_key, now)
            prev = math.floor(float(before) * float(prev_weight) / 1_000_000)
        return self.counter_value(key, now) + prev, prev

    def current(self, b: BucketCharge, now_ms: int, now: int) -> tuple[int, int, bool]:
        """A bucket's value as admit.lua reads it: (value, the previous window's weighted
        share, whether the request's end user is already in a ``users`` set: the member
        travels as ``prev_key``).  A concurrency set first drops the leases past ``now_ms``."""
        if b.kind == "concurrency":
            self.drop_scores_up_to(b.key, now_ms, now)
            z = self.typed(b.key, Scored, now)
            return (len(z.members) if z is not None else 0), 0, False
        if b.kind == "users":
            z = self.typed(b.key, Scored, now)
            members = z.members if z is not None else {}
            seen = b.prev_key in members
            return len(members) - int(seen), 0, seen
        value, share = self.windowed(b.key, b.prev_key, b.prev_weight, now)
        return value, share, False

    def drop_scores_up_to(self, key: str, limit: int, now: int) -> None:
        """ZREMRANGEBYSCORE key -inf limit (slots whose lease ran out)."""
        z = self.typed(key, Scored, now)
        if z is None:
            return
        for member, score in list(z.members.items()):
            if score <= limit:
                del z.members[member]
        if not z.members:
            del self.data[key]

    def renew_member(self, key: str, member: str, score: int, now: int) -> None:
        z = self.typed(key, Scored, now)
        if z is not None and member in z.members:
            z.members[member] = score
