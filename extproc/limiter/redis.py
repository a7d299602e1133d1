"""The Redis limiter: the request path's scripts (admit, charge, settle, note, input_stop) and
reads, over a :class:`extproc.limiter.caller.RedisCaller` that bounds, retries, breaks and
journals every call.  ``admit`` and ``settle`` share one copy of the settlement logic
(``settle_lib.lua``, put in front of each): an admission also settles the settlements that
ride on it (:attr:`extproc.limiter.base.AdmitCall.settlements`).  The scripts' arguments are
packed by :mod:`extproc.limiter.layout`; the allowance scripts are
:class:`extproc.limiter.allowance.store.AllowanceStore`'s; the RLS API's counter composes the
same caller (:mod:`extproc.limiter.rls_counter`).

Works with a single Redis server or Redis Cluster (every key of a call shares the tenant's
hash tag, so each script runs on one slot).  Any Redis failure becomes
:class:`extproc.errors.LimiterUnavailable` (how long that can take: :mod:`extproc.limiter.caller`;
a stream charge is also sent again for up to ``stream_tolerance_s``, :meth:`RedisLimiter.charge`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from extproc.clock import Clock
from extproc.core.keys import EXPIRY_SLACK_MS, open_key
from extproc.core.rules import Adjustment, BucketCharge, UnconfirmedCharge
from extproc.errors import LimiterUnavailable
from extproc.limiter import layout
from extproc.limiter.allowance.store import AllowanceStore
from extproc.limiter.base import (
    MAX_RIDERS,
    AdmitCall,
    AdmitResult,
    AllowanceGrant,
    AllowanceLease,
    AllowanceTake,
    ChargeCall,
    ChargeResult,
    InputNote,
    SettleCall,
    any_ledger,
)
from extproc.limiter.breaker import BreakerSettings, CircuitBreaker
from extproc.limiter.caller import DEFAULT_FAILOVER_WAIT_S, RedisCaller, Where, starved_ceiling_s
from extproc.limiter.failover import Failover
from extproc.limiter.journal import DEFAULT_WINDOW_S
from extproc.limiter.packing import use_hiredis_packing
from extproc.limiter.redis_url import async_client
from extproc.limiter.set_reads import SetReads

if TYPE_CHECKING:
    from extproc.metrics import Metrics

#: Connections per process to a single Redis server; more concurrent calls queue for one.
DEFAULT_MAX_CONNECTIONS = 128

#: The request path's scripts (the allowance store and the RLS counter register their own).
_SCRIPTS = ("admit", "charge", "settle", "note", "input_stop", "leave")


class RedisLimiter(SetReads):
    """:class:`extproc.limiter.base.Limiter` over Redis (single server or Cluster)."""

    def __init__(
        self,
        client: Any,
        *,
        timeout_ms: int = 250,
        cooldown_ms: int = 1000,
        clock: Clock | None = None,
        breaker: BreakerSettings | None = None,
        stall_retries: int = 1,
        metrics: Metrics | None = None,
        journal_s: float = DEFAULT_WINDOW_S,
        stream_tolerance_s: float = 0.0,
        failover_wait_s: float = DEFAULT_FAILOVER_WAIT_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.caller = RedisCaller(
            client,
            timeout_ms=timeout_ms,
            cooldown_ms=cooldown_ms,
            clock=clock,
            breaker=breaker,
            stall_retries=stall_retries,
            metrics=metrics,
            journal_s=journal_s,
            failover_wait_s=failover_wait_s,
            monotonic=monotonic,
        )
        #: how long a stream charge keeps being sent again (same sequence number) before its
        #: stream gives up on it: a failover shorter than this does not cut streams in flight
        self.stream_tolerance_s = stream_tolerance_s
        for name in _SCRIPTS:
            self.caller.register(name)
        self.allowances = AllowanceStore(self.caller)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        timeout_ms: int = 250,
        cooldown_ms: int = 1000,
        clock: Clock | None = None,
        breaker: BreakerSettings | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        metrics: Metrics | None = None,
        journal_s: float = DEFAULT_WINDOW_S,
        stream_tolerance_s: float = 0.0,
        failover_wait_s: float = DEFAULT_FAILOVER_WAIT_S,
    ) -> RedisLimiter:
        """Connect to ``redis://host:port/db``, ``redis+cluster://host:port`` or
        ``redis+sentinel://host:port[,host:port...]/<master>[/db]`` (lazily; see
        :mod:`extproc.limiter.redis_url`).

        A single server (or a Sentinel group's master) gets a ``BlockingConnectionPool`` of
        ``max_connections``: a call that finds every connection busy waits for one (within
        its ``timeout_ms``) instead of failing with "Too many connections".
        """
        t = starved_ceiling_s(timeout_ms / 1000.0)  # the per-call bound is fair_wait's
        client = async_client(url, timeout_s=t, max_connections=max_connections, pool_timeout_s=t)
        use_hiredis_packing(client)
        return cls(
            client,
            timeout_ms=timeout_ms,
            cooldown_ms=cooldown_ms,
            clock=clock,
            breaker=breaker,
            metrics=metrics,
            journal_s=journal_s,
            stream_tolerance_s=stream_tolerance_s,
            failover_wait_s=failover_wait_s,
        )

    # -- the caller's state, as the gateway, the bench and the tests read it ------------------

    @property
    def breaker(self) -> CircuitBreaker:
        """The circuit breaker every call goes through."""
        return self.caller.breaker

    @property
    def failover(self) -> Failover | None:
        """The failover journal and recovery (None: journalling off)."""
        return self.caller.failover

    @property
    def metrics(self) -> Metrics | None:
        """The metrics the calls report to."""
        return self.caller.metrics

    @property
    def round_trips(self) -> int:
        """Calls sent to Redis (attempts)."""
        return self.caller.round_trips

    @property
    def waited_calls(self) -> int:
        """Calls that found Redis unavailable and were sent again."""
        return self.caller.waited_calls

    @property
    def waits_exhausted(self) -> int:
        """Of :attr:`waited_calls`, those that failed all the same."""
        return self.caller.waits_exhausted

    @property
    def stall_retries(self) -> int:
        """Attempts after a timed-out one."""
        return self.caller.stall_retries

    @stall_retries.setter
    def stall_retries(self, value: int) -> None:
        self.caller.stall_retries = value

    @property
    def timeout_ms(self) -> int:
        """The per-attempt bound in milliseconds."""
        return self.caller.timeout_ms

    def configure(
        self,
        *,
        timeout_ms: int | None = None,
        cooldown_ms: int | None = None,
        breaker: BreakerSettings | None = None,
    ) -> None:
        """Apply failure settings to the running limiter (SIGHUP reload)."""
        self.caller.configure(timeout_ms=timeout_ms, cooldown_ms=cooldown_ms, breaker=breaker)

    def pool_in_use(self) -> int:
        """Connections checked out of the single-server pool now (0 for Cluster)."""
        return self.caller.pool_in_use()

    # -- admission, stream charges, settlement -------------------------------------------------

    async def admit(self, call: AdmitCall) -> AdmitResult:
        """Run ``admit.lua`` over every bucket (reclaiming the tenant's dead reservations),
        after applying ``call.settlements`` (riders: each settled once, as :meth:`settle_many`
        would; on Cluster each must be in the ledger's slot, see :meth:`rides_with`)."""
        if len(call.settlements) > MAX_RIDERS:
            raise ValueError(f"at most {MAX_RIDERS} settlements ride on one admission")
        packed = layout.admission(call)
        where = self.caller.owner(call.ledger)
        res = await self.caller.run("admission", "admit", packed, where)
        result = layout.admit_result(res)
        # Journalled whether this answer applied it or found it applied: a duplicate or an
        # already settled rider is this call's own earlier attempt, one that timed out and ran
        # all the same, perhaps on a master about to be replaced.  Replays are idempotent, so
        # a true duplicate costs nothing.
        if result.admitted or result.duplicate:  # every bucket shadow: counted, never refused
            replay = layout.Packed(packed.keys, packed.replay())
            self.caller.journal("admit", replay, call.ledger_ttl_ms, where)
        elif call.settlements:
            self._journal_settlements(call.settlements, where)
        return result

    async def leave_queue(self, ledger: str, keys: tuple[str, str, str]) -> bool:
        """Run ``leave.lua``: the waiting request's ticket leaves its tenant's queue."""
        packed = layout.Packed(list(keys), [ledger])
        res = await self.caller.run("a queue leave", "leave", packed, self.caller.owner(ledger))
        return bool(int(res))

    def rides_with(self, ledger: str) -> Callable[[str], bool]:
        """Which settlements (by ledger) may ride on ``ledger``'s admission: any on a single
        server, those of the same slot on Cluster (one script call runs on one slot)."""
        if not self.caller.cluster:
            return any_ledger
        slot = self.caller.slot(ledger)
        return lambda other: self.caller.slot(other) == slot

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
        """Run ``charge.lua`` for one stream: a lazy batch or a strict lease.  While Redis
        does not answer, the same charge (same sequence number: applied once) is sent again
        for up to :attr:`stream_tolerance_s` before the stream is told (a failover shorter
        than that leaves the stream running; it only waits for this answer when it needs it)."""
        call = ChargeCall(ledger, seq, buckets, amount, strict, ledger_ttl_ms)
        packed = layout.charges([call])
        now = self.caller.monotonic
        give_up = now() + self.stream_tolerance_s
        maybe_ran = False
        while True:
            where = self.caller.owner(ledger)
            try:
                res = await self.caller.run("a stream charge", "charge", packed, where)
                break
            except LimiterUnavailable as exc:
                maybe_ran = maybe_ran or exc.maybe_ran
                left = give_up - now()
                if left <= 0:
                    if maybe_ran and not exc.maybe_ran:
                        raise LimiterUnavailable(str(exc), maybe_ran=True) from exc
                    raise
                await asyncio.sleep(min(0.1, left))
        result = layout.charge_result(res[0])
        self._journal_charge(call, result, where)
        return result

    def _journal_charge(self, call: ChargeCall, result: ChargeResult, where: Where) -> None:
        """Journal a stream charge that added tokens, as the lazy charge of what was granted,
        marked a replay (it still applies on a new master that got the request's settlement
        first, charge.lua)."""
        if self.caller.journals and result.granted > 0:
            replay = layout.charge_replay(call, result.granted)
            self.caller.journal("charge", replay, call.ledger_ttl_ms, where)

    async def charge_many(self, items: list[ChargeCall]) -> list[ChargeResult | None]:
        """Charge many streams with few ``charge.lua`` calls (grouped as :meth:`settle_many`);
        per item its result, or None when its call failed (retrying it is harmless: each
        charge is idempotent by ledger and sequence number)."""

        def read(idx: list[int], res: Any, where: Where) -> list[ChargeResult]:
            out = [layout.charge_result(v) for v in res]
            for i, result in zip(idx, out, strict=True):
                self._journal_charge(items[i], result, where)
            return out

        return await self.caller.batched(
            "a stream charge",
            "charge",
            [c.ledger for c in items],
            lambda idx: layout.charges([items[i] for i in idx]),
            read,
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
        """Run ``settle.lua`` for one request."""
        packed = layout.settlements(
            [SettleCall(ledger, adjustments, ledger_ttl_ms, cancel, unconfirmed)]
        )
        where = self.caller.owner(ledger)
        res = await self.caller.run("settlement", "settle", packed, where)
        # journalled even when found settled: that may be this settlement's own earlier
        # attempt, which timed out and ran (see :meth:`admit`)
        self.caller.journal("settle", packed, ledger_ttl_ms, where)
        return bool(int(res[0]))

    async def settle_many(self, items: list[SettleCall]) -> list[bool | None]:
        """Settle many requests with few ``settle.lua`` calls: one per Cluster slot (every
        slot on a single server) and per :data:`extproc.limiter.caller.MAX_ITEMS_PER_CALL`;
        each item is idempotent by its ledger, as with :meth:`settle`.  Per item: True
        applied, False already settled, None its call failed (retrying it is harmless)."""

        def read(idx: list[int], res: Any, where: Where) -> list[bool]:
            # every one journalled, applied now or before (see settle)
            self._journal_settlements([items[i] for i in idx], where)
            return [bool(int(v)) for v in res]

        return await self.caller.batched(
            "settlement",
            "settle",
            [s.ledger for s in items],
            lambda idx: layout.settlements([items[i] for i in idx]),
            read,
        )

    def _journal_settlements(self, items: Sequence[SettleCall], where: Where) -> None:
        if self.caller.journals:
            for item in items:
                self.caller.journal("settle", layout.settlements([item]), item.ledger_ttl_ms, where)

    async def note_inputs(self, notes: list[InputNote]) -> list[bool | None]:
        """Note exact inputs in open ledgers with few ``note.lua`` calls (grouped as
        :meth:`settle_many`); per note True written, False left as it was, None its call
        failed (retrying it is harmless: a ledger takes one note)."""
        return await self.caller.batched(
            "an input note",
            "note",
            [n.ledger for n in notes],
            lambda idx: layout.notes([notes[i] for i in idx]),
            lambda idx, res, where: [bool(int(v)) for v in res],
        )

    async def stop_input_shortcut(self, key: str, model: str, entry: str, ttl_ms: int) -> bool:
        """``input_stop.lua``: record a model's stopped input shortcut for every replica
        (idempotent: a retry after a timeout changes nothing)."""
        packed = layout.input_stop(key, model, entry, ttl_ms)
        where = (self.caller.slot(key), "")
        res = await self.caller.run("an input shortcut stop", "input_stop", packed, where)
        return bool(int(res))

    async def input_stops(self, key: str) -> list[str]:
        """The models whose input shortcut stopped under this config version (HKEYS)."""
        client = self.caller.client
        names = await self.caller.call(
            "the input shortcut stops",
            "input_stops",
            lambda: client.hkeys(key),
            slot=self.caller.slot(key),
        )
        return [layout.text(n) for n in names]

    # -- allowances (:class:`AllowanceStore`) --------------------------------------------------

    async def take_allowances(
        self, items: list[AllowanceTake], lease: AllowanceLease | None = None
    ) -> list[AllowanceGrant | None]:
        """:meth:`AllowanceStore.take_allowances`."""
        return await self.allowances.take_allowances(items, lease)

    async def open_tranches(
        self, ledger: str, gen: str, items: list[tuple[str, int]]
    ) -> bool | None:
        """:meth:`AllowanceStore.open_tranches`."""
        return await self.allowances.open_tranches(ledger, gen, items)

    async def keep_drafts(
        self,
        ledger: str,
        until_ms: int,
        ttl_ms: int,
        *,
        keep: Sequence[tuple[str, int, str]],
        charged: Sequence[tuple[str, int]],
        drop: Sequence[str],
        more: Sequence[tuple[str, int]] = (),
    ) -> bool | None:
        """:meth:`AllowanceStore.keep_drafts`."""
        return await self.allowances.keep_drafts(
            ledger, until_ms, ttl_ms, keep=keep, charged=charged, drop=drop, more=more
        )

    # -- leases and reads ----------------------------------------------------------------------

    async def renew(
        self, ledgers: list[str], until_ms: int, *, held: dict[str, list[str]] | None = None
    ) -> None:
        """Extend the leases of open reservations and their concurrency slots (ZADD XX: a
        settled one is not re-added)."""
        if not ledgers:
            return
        client = self.caller.client

        async def run() -> Any:
            pipe = client.pipeline(transaction=False)
            for led in ledgers:
                pipe.zadd(open_key(led), {led: until_ms}, xx=True)
                for slot in (held or {}).get(led, ()):
                    pipe.zadd(slot, {led: until_ms}, xx=True)
                    pipe.pexpireat(slot, until_ms + EXPIRY_SLACK_MS)
            return await pipe.execute()

        await self.caller.call("a lease renewal", "renew", run, slot=self.caller.slot(ledgers[0]))

    async def read(self, keys: list[str]) -> list[int]:
        """MGET the counters (one slot: all keys share a tenant's hash tag)."""
        if not keys:
            return []
        client = self.caller.client
        vals = await self.caller.call(
            "a read", "read", lambda: client.mget(keys), slot=self.caller.slot(keys[0])
        )
        return [int(v) if v is not None else 0 for v in vals]

    async def ping(self) -> bool:
        """PING, bypassing the breaker."""
        return await self.caller.ping()

    async def close(self) -> None:
        """Close the connection pool."""
        await self.caller.close()
