"""The in-memory limiter: the whole :class:`extproc.limiter.base.Limiter` protocol in one
process, with the same semantics as the Redis limiter's Lua scripts.

It keeps the scripts' data model (:mod:`extproc.limiter.keyspace`: counters, sorted sets and
ledgers, each key with an optional expiry in unix ms read from a :class:`extproc.clock.Clock`) and runs each
call as the matching script does, step by step, so the contract suite
(``tests/integration/test_limiter_contract.py`` and the scripts' other tests) holds for both.
Every call runs to completion without yielding to the event loop, which makes it atomic like
a script.  Expiry follows Redis: an expiry at or before now deletes the key at once, a key
is gone once now is past its expiry, an empty sorted set does not exist.

For tests and single-process embedding: nothing is shared between processes.  A key holds
one kind of value; using it as another is a caller's bug and raises
:class:`extproc.errors.LimiterUnavailable` (Redis answers WRONGTYPE).  The ``seed_counter``,
``counter``, ``ttl_ms``, ``ledger_state``, ``ledger_draft``, ``score`` and ``members``
methods let a test set up and inspect the state a Redis test reads with its own client.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

from extproc.clock import Clock, SystemClock
from extproc.core.keys import EXPIRY_SLACK_MS, open_key
from extproc.core.rules import RATE_SCALE, Adjustment, BucketCharge, UnconfirmedCharge, ceil_div
from extproc.errors import LimiterUnavailable
from extproc.limiter.allowance import sizing
from extproc.limiter.base import (
    RLS_ENFORCED,
    RLS_QUOTA,
    AdmitCall,
    AdmitResult,
    AllowanceGrant,
    AllowanceLease,
    AllowanceTake,
    ChargeCall,
    ChargeResult,
    InputNote,
    Reclaimed,
    RlsCount,
    SettleCall,
    any_ledger,
)
from extproc.limiter.keyspace import Counter, Keyspace, Ledger, LedgerState, Scored
from extproc.limiter.memory_queue import MemoryQueues

#: Dead reservations one admission reclaims at most (admit.lua's LIMIT).
RECLAIM_BATCH = 8


class MemoryLimiter:
    """:class:`extproc.limiter.base.Limiter` over in-process dictionaries."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock or SystemClock()
        self.keys = Keyspace()
        self.round_trips = 0
        # input_stop.lua's hashes (config version key -> model -> entry); no expiry here
        self._input_stops: dict[str, dict[str, str]] = {}
        self.waiting = MemoryQueues()  # admit.lua's queues (docs/semantics.md, "Waiting")

    # -- the protocol ------------------------------------------------------------------------

    async def admit(self, call: AdmitCall) -> AdmitResult:
        """admit.lua: settle the riders, reclaim the tenant's dead reservations, then charge
        all buckets or none."""
        ledger, buckets, now_ms = call.ledger, call.buckets, call.now_ms
        lease_until_ms, ledger_ttl_ms = call.lease_until_ms, call.ledger_ttl_ms
        self.round_trips += 1
        settled = tuple(self._settle_one(c) for c in call.settlements)
        now = self.clock.now_ms()
        open_set = open_key(ledger)
        alw = [0]
        reclaimed = self._reclaim(open_set, now_ms, now, alw) if now_ms > 0 else []
        vals: list[int] = []
        prev: list[int] = []
        known: set[int] = set()
        for i, b in enumerate(buckets):
            value, share, seen = self.keys.current(b, now_ms, now)
            vals.append(value)
            prev.append(share)
            if seen:
                known.add(i)
        if self.keys.entry(ledger, now) is not None:
            return AdmitResult(False, True, tuple(vals), tuple(reclaimed), settled, alw[0])
        j = self.waiting.judge(call, vals, prev, known, keys=self.keys, now=now)
        if j.ok:
            led = self.keys.ledger(ledger, now)
            led.state, led.seq, led.charged = "admitted", 0, call.tpm_charged
            for i, b in enumerate(buckets):
                if b.kind == "users":
                    if i not in known:
                        self.keys.zadd(b.key, b.prev_key, 0, now)
                        self.keys.expire_at(b.key, b.expire_at_ms, now)
                    vals[i] += 1
                elif b.kind == "concurrency":
                    self.keys.zadd(b.key, ledger, lease_until_ms, now)
                    self.keys.expire_at(b.key, b.expire_at_ms, now)
                    led.slots[b.key] = None
                    vals[i] += 1
                elif b.amount > 0:
                    vals[i] = self.keys.incr(b.key, b.amount, now) + prev[i]
                    self.keys.expire_at(b.key, b.expire_at_ms, now)
                    if lease_until_ms > 0 and b.kind == "tpm" and b.refundable > 0:
                        led.refundable[b.key] = b.refundable
            if lease_until_ms > 0:
                self.keys.zadd(open_set, ledger, lease_until_ms, now)
                self.keys.expire_at(open_set, now + ledger_ttl_ms, now)
                if call.record_draft:
                    led.draft = call.record_draft
            self.keys.expire_at(ledger, now + ledger_ttl_ms, now)
            return AdmitResult(True, False, tuple(vals), tuple(reclaimed), settled, alw[0])
        if call.count_refused and not j.wait:
            for i, b in enumerate(buckets):
                if b.kind == "rpm":
                    vals[i] = self.keys.incr(b.key, 1, now) + prev[i]
                    self.keys.expire_at(b.key, b.expire_at_ms, now)
        return AdmitResult(False, False, tuple(vals), tuple(reclaimed), settled, alw[0], *j[1:])

    async def leave_queue(self, ledger: str, keys: tuple[str, str, str]) -> bool:
        """leave.lua: the waiting request's ticket leaves its tenant's queue."""
        self.round_trips += 1
        return self.waiting.leave(ledger, keys[0])

    def _reclaim(
        self, open_set: str, now_ms: int, now: int, alw: list[int], *, only_alw: bool = False
    ) -> list[Reclaimed]:
        """Settle up to :data:`RECLAIM_BATCH` reservations whose lease ended by ``now_ms``
        (``only_alw``: allowance ledgers only, allowance.lua's); ``alw[0]`` counts the
        allowance units given back."""
        z = self.keys.typed(open_set, Scored, now)
        if z is None:
            return []
        dead = [m for m, score in z.ordered() if score <= now_ms]
        if only_alw:
            dead = dead[: 2 * RECLAIM_BATCH]
            dead = [m for m in dead if (led := self.keys.typed(m, Ledger, now)) and led.gen]
        dead = dead[:RECLAIM_BATCH]
        out: list[Reclaimed] = []
        for name in dead:
            self.keys.zrem(open_set, name, now)
            led = self.keys.typed(name, Ledger, now)
            if led is None or led.state != "admitted":
                continue
            for key, units in led.refundable.items():
                if led.gen and units > 0 and self.keys.entry(key, now) is not None:
                    alw[0] += units
                self.keys.take(key, units, now)
            for key in led.slots:
                self.keys.zrem(key, name, now)
            led.state = "reclaimed"
            if led.draft is not None:
                out.append(Reclaimed(name, led.draft, led.charged, led.input))
                led.draft = None
        return out

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
        """charge.lua: a lazy batch or a strict lease, idempotent by sequence number."""
        self.round_trips += 1
        now = self.clock.now_ms()
        vals: list[int] = []
        prev: list[int] = []
        for b in buckets:
            value, share = self.keys.windowed(b.key, b.prev_key, b.prev_weight, now)
            vals.append(value)
            prev.append(share)
        found = self.keys.typed(ledger, Ledger, now)
        if found is not None and found.state in ("settled", "cancelled"):
            return ChargeResult(0, False, tuple(vals))
        last = found.seq if found is not None else 0
        if seq <= last:
            replayed = found.last_grant if found is not None and seq == last else 0
            return ChargeResult(replayed, False, tuple(vals))
        grant = amount
        if strict:
            for i, b in enumerate(buckets):
                if not b.shadow and b.rate > 0:
                    room = b.limit - vals[i]
                    fits = room * RATE_SCALE // b.rate if room > 0 else 0
                    grant = min(grant, fits)
            grant = max(grant, 0)
        over = False
        for i, b in enumerate(buckets):
            if grant > 0 and b.rate > 0:
                units = ceil_div(grant * b.rate, RATE_SCALE)
                vals[i] = self.keys.incr(b.key, units, now) + prev[i]
                self.keys.expire_at(b.key, b.expire_at_ms, now)
            if not b.shadow and b.rate > 0:
                # strict: not one more token fits; lazy: past the limit (the caller cuts)
                left = b.limit - vals[i]
                over = over or (left * RATE_SCALE < b.rate if strict else left < 0)
        led = self.keys.ledger(ledger, now)
        led.seq, led.last_grant = seq, grant
        led.charged += grant
        self.keys.expire_at(ledger, now + ledger_ttl_ms, now)
        return ChargeResult(grant, over, tuple(vals))

    async def settle(
        self,
        ledger: str,
        adjustments: list[Adjustment],
        *,
        ledger_ttl_ms: int,
        cancel: bool = False,
        unconfirmed: UnconfirmedCharge | None = None,
    ) -> bool:
        """settle.lua: apply the corrections once, free the slots, drop the record draft."""
        self.round_trips += 1
        return self._settle_one(SettleCall(ledger, adjustments, ledger_ttl_ms, cancel, unconfirmed))

    def rides_with(self, ledger: str) -> Callable[[str], bool]:
        """Every settlement may ride on any admission (one store, no slots)."""
        return any_ledger

    def _settle_one(self, call: SettleCall) -> bool:
        """One request's settlement (settle_lib.lua's ``settle``)."""
        ledger, adjustments, ledger_ttl_ms = call.ledger, call.adjustments, call.ledger_ttl_ms
        cancel, unconfirmed = call.cancel, call.unconfirmed
        now = self.clock.now_ms()
        self.keys.zrem(open_key(ledger), ledger, now)
        found = self.keys.typed(ledger, Ledger, now)
        state = found.state if found is not None else None
        if state in ("settled", "cancelled"):
            return False
        if found is not None:
            found.draft = None
            for key in found.slots:
                self.keys.zrem(key, ledger, now)
        if cancel and state not in ("admitted", "reclaimed"):
            self.keys.ledger(ledger, now).state = "cancelled"
            self.keys.expire_at(ledger, now + ledger_ttl_ms, now)
            return True
        if found is not None and state == "reclaimed":
            # reclaimed as abandoned while its processor lived (a renewal was lost): put the
            # refunded reservation back, then apply the corrections as computed
            for key, units in found.refundable.items():
                c = self.keys.typed(key, Counter, now)
                if c is not None:
                    c.value += units
        if unconfirmed is not None and found is not None and 0 < unconfirmed.seq <= found.seq:
            # the charge whose answer never came ran: take back what it added
            for key, rate in unconfirmed.rates:
                self.keys.take(key, ceil_div(found.last_grant * rate, RATE_SCALE), now)
        for a in adjustments:
            if a.amount > 0:
                self.keys.incr(a.key, a.amount, now)
                self.keys.expire_at(a.key, a.expire_at_ms, now)
            elif a.amount < 0:
                self.keys.take(a.key, -a.amount, now)
        self.keys.ledger(ledger, now).state = "settled"
        self.keys.expire_at(ledger, now + ledger_ttl_ms, now)
        return True

    async def settle_many(self, items: list[SettleCall]) -> list[bool | None]:
        """Settle each item in order as :meth:`settle` does (as settle.lua does a batch); an
        item that fails, and every item after it, is None (not settled)."""
        out: list[bool | None] = []
        for it in items:
            try:
                out.append(
                    await self.settle(
                        it.ledger,
                        it.adjustments,
                        ledger_ttl_ms=it.ledger_ttl_ms,
                        cancel=it.cancel,
                        unconfirmed=it.unconfirmed,
                    )
                )
            except LimiterUnavailable:
                break
        return out + [None] * (len(items) - len(out))

    async def charge_many(self, items: list[ChargeCall]) -> list[ChargeResult | None]:
        """Charge each item in order as :meth:`charge` does (a batch of charge.lua); an item
        that fails, and every item after it, is None (a later charge of a stream must never
        run before an earlier one)."""
        out: list[ChargeResult | None] = []
        for it in items:
            try:
                out.append(
                    await self.charge(
                        it.ledger,
                        it.seq,
                        it.buckets,
                        it.amount,
                        strict=it.strict,
                        ledger_ttl_ms=it.ledger_ttl_ms,
                    )
                )
            except LimiterUnavailable:
                break
        return out + [None] * (len(items) - len(out))

    async def take_allowances(
        self, items: list[AllowanceTake], lease: AllowanceLease | None = None
    ) -> list[AllowanceGrant | None]:
        """As ``allowance.lua``: per item (granted, value after, the allowance ledger's
        generation, units reclaimed on the first)."""
        self.round_trips += 1
        now = self.clock.now_ms()
        alw = [0]
        gen = ""
        led: Ledger | None = None
        tranches = 1
        if lease is not None:
            open_set = open_key(lease.ledger)
            self._reclaim(open_set, lease.now_ms, now, alw, only_alw=True)
            tranches = max(lease.tranches, 1)
            led = self.keys.typed(lease.ledger, Ledger, now)
            if led is None or led.state != "admitted":
                self.keys.data.pop(lease.ledger, None)
                led = self.keys.ledger(lease.ledger, now)
                led.state, led.gen = "admitted", uuid.uuid4().hex
            gen = led.gen
            self.keys.expire_at(lease.ledger, now + lease.ttl_ms, now)
            self.keys.zadd(open_set, lease.ledger, lease.until_ms, now)
            z = self.keys.typed(open_set, Scored, now)
            if z is not None and (z.expire_at is None or z.expire_at < now + lease.ttl_ms):
                z.expire_at = now + lease.ttl_ms
        out: list[AllowanceGrant | None] = []
        for t in items:
            value = self.keys.counter_value(t.key, now)
            grant = sizing.grant(t.want, t.limit, value, t.share_ppm, held=t.held, least=t.least)
            if grant > 0:
                value = self.keys.incr(t.key, grant, now)
                self.keys.expire_at(t.key, t.expire_at_ms, now)
                tranche = sizing.tranche_size(t.held, grant, tranches, t.least)
                closed = sizing.closed_of_grant(grant, tranche, t.opened)
                if led is not None and closed > 0:
                    led.refundable[t.key] = led.refundable.get(t.key, 0) + closed
            out.append(AllowanceGrant(grant, value, gen, alw[0] if not out else 0))
        return out

    async def open_tranches(
        self, ledger: str, gen: str, items: list[tuple[str, int]]
    ) -> bool | None:
        """As ``tranche.lua``: take the units off the ledger's record if it is still held
        (same generation)."""
        self.round_trips += 1
        now = self.clock.now_ms()
        led = self.keys.typed(ledger, Ledger, now)
        if led is None or led.state != "admitted" or led.gen != gen:
            return False
        for key, units in items:
            rec = led.refundable.get(key, 0)
            led.refundable[key] = rec - min(rec, units)
        return True

    async def note_inputs(self, notes: list[InputNote]) -> list[bool | None]:
        """note.lua: each note once, into a ledger still open."""
        self.round_trips += 1
        now = self.clock.now_ms()
        out: list[bool | None] = []
        for note in notes:
            led = self.keys.typed(note.ledger, Ledger, now)
            if led is None or led.state != "admitted" or led.input >= 0:
                out.append(False)
                continue
            led.input = note.input_tokens
            for key, units in note.refund:
                if units > 0:
                    led.refundable[key] = led.refundable.get(key, 0) + units
            out.append(True)
        return out

    async def stop_input_shortcut(self, key: str, model: str, entry: str, ttl_ms: int) -> bool:
        """input_stop.lua: the first entry for ``model`` is kept (the expiry is not modelled)."""
        self.round_trips += 1
        stops = self._input_stops.setdefault(key, {})
        if model in stops:
            return False
        stops[model] = entry
        return True

    async def input_stops(self, key: str) -> list[str]:
        """The models stopped under ``key`` (HKEYS)."""
        self.round_trips += 1
        return list(self._input_stops.get(key, {}))

    async def renew(
        self, ledgers: list[str], until_ms: int, *, held: dict[str, list[str]] | None = None
    ) -> None:
        """Extend open reservations and their slots that are still there (ZADD XX)."""
        if not ledgers:
            return
        self.round_trips += 1
        now = self.clock.now_ms()
        for led in ledgers:
            self.keys.renew_member(open_key(led), led, until_ms, now)
            for slot in (held or {}).get(led, ()):
                self.keys.renew_member(slot, led, until_ms, now)
                self.keys.expire_at(slot, until_ms + EXPIRY_SLACK_MS, now)

    async def read(self, keys: list[str]) -> list[int]:
        """Counter values; 0 for a missing key (or one that is not a counter, as MGET)."""
        self.round_trips += 1 if keys else 0
        now = self.clock.now_ms()
        return [e.value if isinstance(e := self.keys.entry(k, now), Counter) else 0 for k in keys]

    async def count_slots(self, keys: list[str], now_ms: int) -> list[int]:
        """Slots of each concurrency set whose lease runs past ``now_ms``."""
        return self._count(keys, lambda z: sum(1 for s in z.members.values() if s > now_ms))

    async def count_members(self, keys: list[str]) -> list[int]:
        """Members of each set (``admit``'s sets of a team's end users)."""
        return self._count(keys, lambda z: len(z.members))

    def _count(self, keys: list[str], count: Callable[[Scored], int]) -> list[int]:
        self.round_trips += 1 if keys else 0
        now = self.clock.now_ms()
        return [count(z) if (z := self.keys.typed(k, Scored, now)) is not None else 0 for k in keys]

    async def rls_check(self, counters: Sequence[RlsCount]) -> tuple[bool, list[int]]:
        """The RLS API's check (``rls.lua``; :class:`extproc.limiter.base.RlsCounter`): every
        counter checked, then counted all or none; (admitted, values before the request).
        Nothing here is retried, so the script's call id has nothing to guard."""
        if not counters:
            return True, []
        self.round_trips += 1
        now = self.clock.now_ms()
        running: dict[str, int] = {}
        before: list[int] = []
        refused = False
        quota_total = quota_over = 0
        for key, hits, limit, _, mode in counters:
            value = running[key] if key in running else self.keys.counter_value(key, now)
            before.append(value)
            running[key] = value + hits
            over = value + hits > limit
            if mode == RLS_ENFORCED and over:
                refused = True
            elif mode == RLS_QUOTA:
                quota_total += 1
                quota_over += over
        if refused or (quota_total > 0 and quota_over == quota_total):
            return False, before
        for key, hits, _, expire_at, _ in counters:
            if hits > 0 and self.keys.incr(key, hits, now) == hits:
                self.keys.expire_at(key, expire_at, now)
        return True, before

    async def ping(self) -> bool:
        """Always answers."""
        return True

    async def close(self) -> None:
        """Nothing to release (the state stays readable)."""

    # -- set-up and inspection (what a Redis test does with its own client) --------------------

    def seed_counter(self, key: str, value: int, *, ttl_ms: int | None = None) -> None:
        """SET ``key`` ``value`` (PX ``ttl_ms``): a counter as another writer left it."""
        now = self.clock.now_ms()
        self.keys.data[key] = Counter(value)
        if ttl_ms is not None:
            self.keys.expire_at(key, now + ttl_ms, now)

    def counter(self, key: str) -> int | None:
        """A counter's value; None when it does not exist."""
        c = self.keys.typed(key, Counter, self.clock.now_ms())
        return c.value if c is not None else None

    def ttl_ms(self, key: str) -> int:
        """PTTL: ms left; -1 without expiry; -2 when the key does not exist."""
        now = self.clock.now_ms()
        entry = self.keys.entry(key, now)
        if entry is None:
            return -2
        return -1 if entry.expire_at is None else entry.expire_at - now

    def ledger_state(self, ledger: str) -> LedgerState | None:
        """A ledger's state; None when it has none (or does not exist)."""
        led = self.keys.typed(ledger, Ledger, self.clock.now_ms())
        return led.state if led is not None else None

    def ledger_draft(self, ledger: str) -> str | None:
        """The record draft a ledger still holds."""
        led = self.keys.typed(ledger, Ledger, self.clock.now_ms())
        return led.draft if led is not None else None

    def score(self, key: str, member: str) -> int | None:
        """A member's score in a sorted set (slots, open reservations)."""
        z = self.keys.typed(key, Scored, self.clock.now_ms())
        return z.members.get(member) if z is not None else None

    def members(self, key: str) -> int:
        """How many members a sorted set has (ZCARD)."""
        z = self.keys.typed(key, Scored, self.clock.now_ms())
        return len(z.members) if z is not None else 0
