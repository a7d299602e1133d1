"""The Redis limiter: its Lua scripts registered once (admit, charge, settle, note, allowance,
tranche), a bounded timeout, a circuit breaker.  ``admit`` and ``settle`` share one copy of the
settlement logic (``settle_lib.lua``, put in front of each): an admission also settles the
settlements that ride on it (:meth:`RedisLimiter.admit`'s ``settlements``).  The RLS API's
counter runs its own script through the same calls (:mod:`extproc.limiter.rls_counter`).

Works with a single Redis server or Redis Cluster (every key of a call shares the tenant's
hash tag, so each script runs on one slot).  Any Redis failure becomes
:class:`extproc.errors.LimiterUnavailable`; how long that can take:

- each attempt is bounded by ``timeout_ms`` of the processor's *running* time (waiting for a
  pooled connection included: the single-server pool is a ``BlockingConnectionPool`` of
  ``max_connections``, so a burst beyond it queues for a free connection instead of failing).
  Time the processor could not run (starved of CPU) is added, up to ``starved_ceiling_s``, so
  a slow processor is not mistaken for a dead Redis (:mod:`extproc.limiter.starvation`); the
  sockets' own timeouts are that ceiling;
- a call that *timed out* (Redis stalled, e.g. a slow command or a fork) is tried again
  ``stall_retries`` times (default once) while the breaker stays closed: every script is
  idempotent by ledger (and sequence number), so a first attempt that ran after all is not
  charged twice.  A 0.3-0.5 s stall is ridden out within ``2 x timeout_ms``; a refused
  connection (Redis down) is not retried and fails at once;
- the :class:`extproc.limiter.breaker.CircuitBreaker` opens on a failure *rate* over a short
  rolling window (never on one slow call), then fails calls at once for ``cooldown_ms`` and
  probes Redis with a few half-open calls before closing;
- a call that finds Redis unavailable (refused, reset, READONLY, no master, the breaker open,
  timed out past its stall retry) *waits*: it is sent again, the same call (idempotent), every
  50-250 ms until ``failover_wait_s`` after it started (:func:`failover_pause`), so a replica's
  promotion or a restart costs callers a pause, not an error.  Only past that bound does
  :class:`LimiterUnavailable` reach the caller (and its plan's failure mode apply).

Timeouts, the pool and the breaker can be changed on a live limiter (:meth:`RedisLimiter.configure`,
called on SIGHUP reload).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from importlib import resources
from typing import TYPE_CHECKING, Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from extproc.clock import Clock, SystemClock
from extproc.core.keys import EXPIRY_SLACK_MS, open_key
from extproc.core.rules import Adjustment, BucketCharge, UnconfirmedCharge
from extproc.errors import LimiterUnavailable
from extproc.limiter.base import (
    MAX_RIDERS,
    AdmitResult,
    AllowanceGrant,
    AllowanceLease,
    AllowanceTake,
    ChargeCall,
    ChargeResult,
    InputNote,
    Reclaimed,
    SettleCall,
    any_ledger,
)
from extproc.limiter.breaker import BreakerSettings, BreakerState, CircuitBreaker
from extproc.limiter.failover import Failover
from extproc.limiter.journal import DEFAULT_WINDOW_S, Journal
from extproc.limiter.packing import use_hiredis_packing
from extproc.limiter.redis_url import async_client
from extproc.limiter.starvation import LoopLag, fair_wait

if TYPE_CHECKING:
    from extproc.metrics import Metrics

T = TypeVar("T")

_ERRORS = (
    redis.exceptions.RedisError,
    ConnectionError,
    OSError,
    TimeoutError,
    asyncio.TimeoutError,
)

_KIND = {"rpm": "r", "tpm": "t", "concurrency": "c", "users": "u"}

#: Most settlements or charges in one script call (a script blocks Redis while it runs: 64
#: settlements take well under a millisecond).
MAX_ITEMS_PER_CALL = 64

#: Connections per process to a single Redis server; more concurrent calls queue for one.
DEFAULT_MAX_CONNECTIONS = 128

#: How long an RLS call's id is kept (ms): a retry or a journal replay within it counts nothing.
RLS_CALL_ID_TTL_MS = 60_000


#: Default of :attr:`RedisLimiter.failover_wait_s` for a limiter built directly (the served
#: processor takes ``AIQ_REDIS_FAILOVER_WAIT_S``, default :data:`extproc.settings` 8 s).
DEFAULT_FAILOVER_WAIT_S = 0.0


def failover_pause(waited: int) -> float:
    """The pause before the ``waited``-th resend of a call that found Redis unavailable: 50 ms,
    doubling to at most 250 ms (a promotion is seen within a quarter second)."""
    return min(0.05 * float(2 ** min(waited, 3)), 0.25)


def may_wait(elapsed_s: float, pause_s: float, wait_s: float) -> bool:
    """Whether a call that started ``elapsed_s`` ago and found Redis unavailable is sent again
    after ``pause_s``: only while that stays within its ``wait_s`` bound."""
    return wait_s > 0 and elapsed_s + pause_s <= wait_s


def starved_ceiling_s(timeout_s: float) -> float:
    """The longest a call may wait, in wall time, while the processor is starved of CPU."""
    return max(20 * timeout_s, 10.0)


#: Scripts that settle: the shared settlement functions go in front of their text.
_SETTLING = frozenset({"admit", "settle"})
#: Scripts whose reclaim hands back the drafts of dead replicas' draft ledgers.
_DRAFTING = frozenset({"admit", "allowance"})


def _lua(name: str) -> str:
    return resources.files("extproc.limiter").joinpath(f"lua/{name}.lua").read_text("utf-8")


def load_script(name: str) -> str:
    """The text of a packaged ``.lua`` script, as registered (``admit`` and ``settle`` with
    ``settle_lib.lua`` in front)."""
    text = _lua(name)
    if name in _DRAFTING:
        text = _lua("drafts_lib") + "\n" + text
    return _lua("settle_lib") + "\n" + text if name in _SETTLING else text


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError | asyncio.TimeoutError | redis.exceptions.TimeoutError)


class RedisLimiter:
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
    ) -> None:
        self._client = client
        #: how long a call that finds Redis unavailable is sent again before it fails (a
        #: replica's promotion or a restart shorter than this fails nothing; 0: at once)
        self.failover_wait_s = failover_wait_s
        #: calls that found Redis unavailable and waited (were sent again), and of those the
        #: ones that failed all the same past the bound
        self.waited_calls = 0
        self.waits_exhausted = 0
        #: how long a stream charge keeps being sent again (same sequence number) before its
        #: stream gives up on it: a failover shorter than this does not cut streams in flight
        self.stream_tolerance_s = stream_tolerance_s
        self._cluster = isinstance(client, RedisCluster)
        self._clock = clock or SystemClock()
        self._timeout = timeout_ms / 1000.0
        self.lag = LoopLag()
        base = breaker or BreakerSettings()
        self.breaker = CircuitBreaker(
            self._clock, _with_open_s(base, cooldown_ms) if breaker is None else base
        )
        self.stall_retries = stall_retries
        self.metrics = metrics
        self.round_trips = 0
        self._admit = client.register_script(load_script("admit"))
        self._charge = client.register_script(load_script("charge"))
        self._settle = client.register_script(load_script("settle"))
        self._note = client.register_script(load_script("note"))
        self._allowance = client.register_script(load_script("allowance"))
        self._tranche = client.register_script(load_script("tranche"))
        self._drafts = client.register_script(load_script("drafts"))
        self._input_stop = client.register_script(load_script("input_stop"))
        self._export_state()
        # every script a journalled call may have run, by name (a script registered later,
        # :meth:`register`, joins it)
        self._scripts: dict[str, Any] = {
            "admit": self._admit,
            "charge": self._charge,
            "settle": self._settle,
            "allowance": self._allowance,
            "tranche": self._tranche,
        }
        # Redis HA: acknowledged charges kept journal_s seconds and replayed to a new master
        # (extproc.limiter.failover); 0 turns it off.
        self.failover: Failover | None = None
        if journal_s > 0:
            self.failover = Failover(
                client,
                self._scripts,
                Journal(window_s=journal_s),
                metrics=metrics,
                on_recovered=self._recovered,
                lag=self.lag,
            )

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

        A single server (or a Sentinel group's master) gets a ``BlockingConnectionPool`` of ``max_connections``: a call that
        finds every connection busy waits for one (within its ``timeout_ms``) instead of
        failing with "Too many connections".
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

    # -- live settings -----------------------------------------------------------------------

    @property
    def timeout_ms(self) -> int:
        """The per-attempt bound in milliseconds."""
        return round(self._timeout * 1000)

    def configure(
        self,
        *,
        timeout_ms: int | None = None,
        cooldown_ms: int | None = None,
        breaker: BreakerSettings | None = None,
    ) -> None:
        """Apply failure settings to the running limiter (SIGHUP reload).

        The per-attempt bound applies to the next call, and so do the pool's wait for a free
        connection and the sockets' own timeouts (pooled connections are updated in place).
        """
        if timeout_ms is not None:
            self._timeout = timeout_ms / 1000.0
            ceiling = starved_ceiling_s(self._timeout)
            pool = getattr(self._client, "connection_pool", None)
            if isinstance(pool, aioredis.BlockingConnectionPool):
                pool.timeout = ceiling
                kwargs = pool.connection_kwargs
                kwargs["socket_timeout"] = ceiling
                kwargs["socket_connect_timeout"] = ceiling
                for conn in [*pool._available_connections, *pool._in_use_connections]:
                    conn.socket_timeout = ceiling
                    conn.socket_connect_timeout = ceiling
        settings = breaker or self.breaker.settings
        if cooldown_ms is not None and breaker is None:
            settings = _with_open_s(settings, cooldown_ms)
        if settings != self.breaker.settings:
            self.breaker.configure(settings)

    # -- state -------------------------------------------------------------------------------

    def pool_in_use(self) -> int:
        """Connections checked out of the single-server pool now (0 for Cluster)."""
        pool = getattr(self._client, "connection_pool", None)
        in_use = getattr(pool, "_in_use_connections", None)
        return len(in_use) if in_use is not None else 0

    def _export_state(self) -> None:
        m = self.metrics
        if m is not None:
            m.breaker_state.set(int(self.breaker.state))
            m.redis_pool_in_use.set(self.pool_in_use())

    def _observe(self, script: str, outcome: str, started: float) -> None:
        m = self.metrics
        if m is not None:
            m.redis_seconds.labels(script, outcome).observe(time.perf_counter() - started)

    # -- calls -------------------------------------------------------------------------------

    async def _call(
        self,
        what: str,
        script: str,
        make: Callable[[], Awaitable[T]],
        *,
        retry: bool = True,
        slot: int = 0,
    ) -> T:
        """Run ``make()`` against Redis under the timeout, the stall retry (``retry``: the
        call is idempotent) and the breaker."""
        attempt = 0
        waited = 0
        first = time.monotonic()
        maybe_ran = False  # an attempt timed out: Redis may still run it when it wakes up
        while True:
            started = time.perf_counter()
            if not self.breaker.allow():
                self._observe(script, "breaker", started)
                self._export_state()
                if retry and await self._wait(first, waited):
                    waited += 1
                    continue
                self._exhausted(waited)
                raise LimiterUnavailable(
                    "the quota backend (Redis) is unavailable; retry shortly", maybe_ran=maybe_ran
                )
            self.round_trips += 1
            try:
                result = await fair_wait(
                    self._after_failover(make, slot),
                    self._timeout,
                    self.lag,
                    starved_ceiling_s(self._timeout),
                )
            except asyncio.CancelledError:
                self.breaker.abandon()
                raise
            except _ERRORS as exc:
                if self.failover is not None:
                    self.failover.failed()
                timed_out = _is_timeout(exc)
                maybe_ran = maybe_ran or timed_out
                self._observe(script, "timeout" if timed_out else "error", started)
                self.breaker.record(False)
                self._export_state()
                if retry and timed_out and attempt < self.stall_retries:
                    attempt += 1
                    continue
                if retry and await self._wait(first, waited):
                    waited += 1
                    continue
                self._exhausted(waited)
                raise LimiterUnavailable(
                    f"the quota backend (Redis) did not answer {what} in time: {type(exc).__name__}",
                    maybe_ran=maybe_ran,
                ) from exc
            self._observe(script, "ok", started)
            self.breaker.record(True)
            if self.failover is not None:
                self.failover.answered()
            self._export_state()
            return result

    async def _wait(self, first: float, waited: int) -> bool:
        """Pause before sending a call again that found Redis unavailable, when its
        :attr:`failover_wait_s` bound allows (False: it fails now)."""
        pause = failover_pause(waited)
        if not may_wait(time.monotonic() - first, pause, self.failover_wait_s):
            return False
        if waited == 0:
            self.waited_calls += 1
            if self.metrics is not None:
                self.metrics.redis_waits.labels("waited").inc()
        await asyncio.sleep(pause)
        return True

    def _exhausted(self, waited: int) -> None:
        if waited:
            self.waits_exhausted += 1
            if self.metrics is not None:
                self.metrics.redis_waits.labels("failed").inc()

    async def _after_failover(self, make: Callable[[], Awaitable[T]], slot: int) -> T:
        """``make()``, after the journal was replayed to a new master if one may have taken
        over (extproc.limiter.failover)."""
        if self.failover is not None and self.failover.suspect:
            await self.failover.ensure(slot)
        return await make()

    def _recovered(self, new_master: bool) -> None:
        """A recovery ended; a new master answered and caught up: let traffic back now."""
        if new_master and self.breaker.state is not BreakerState.CLOSED:
            self.breaker.reset()
            self._export_state()

    def _slot(self, key: str) -> int:
        return key_slot(key.encode()) if self._cluster else 0

    def _owner(self, key: str) -> tuple[int, str]:
        """(slot, run id of its master as known now) of a call about to be sent."""
        slot = self._slot(key)
        return slot, (self.failover.owner(slot) if self.failover is not None else "")

    def _journal(
        self, script: str, keys: list[str], args: list[Any], ttl_ms: int, where: tuple[int, str]
    ) -> None:
        if self.failover is not None:
            self.failover.record(script, keys, args, ttl_ms, slot=where[0], owner=where[1])

    def _journal_settlements(self, items: Sequence[SettleCall], where: tuple[int, str]) -> None:
        for item in items:
            keys: list[str] = []
            args: list[Any] = [1]
            _pack_settlement(keys, args, item)
            self._journal("settle", keys, args, item.ledger_ttl_ms, where)

    # -- for callers composed with the limiter (the RLS counter) -----------------------------

    def register(self, name: str) -> None:
        """Register the packaged script ``name`` on this limiter's client, for :meth:`run`
        (and for a replay of the calls :meth:`journal` records, after a failover)."""
        if name not in self._scripts:
            self._scripts[name] = self._client.register_script(load_script(name))

    def slot(self, key: str) -> int:
        """The Cluster slot of ``key`` (0 on a single server)."""
        return self._slot(key)

    def owner(self, key: str) -> tuple[int, str]:
        """(slot, run id of its master as known now) of a call about to be sent on ``key``."""
        return self._owner(key)

    async def run(
        self, what: str, name: str, keys: list[str], args: list[Any], where: tuple[int, str]
    ) -> Any:
        """Run registered script ``name`` under the limiter's bounded timeout, stall retry
        (the call must be idempotent), circuit breaker and failover catch-up; raises
        :class:`LimiterUnavailable` (``what`` names the call in its message)."""
        return await self._call(
            what, name, _script_call(self._scripts[name], keys, args), slot=where[0]
        )

    def journal(
        self, name: str, keys: list[str], args: list[Any], ttl_ms: int, where: tuple[int, str]
    ) -> None:
        """Keep an acknowledged call of script ``name`` for a replay to a new master (the
        arguments it must be replayed with: it must count nothing twice)."""
        self._journal(name, keys, args, ttl_ms, where)

    async def admit(
        self,
        ledger: str,
        buckets: list[BucketCharge],
        *,
        tpm_charged: int,
        count_refused: bool,
        ledger_ttl_ms: int,
        now_ms: int = 0,
        lease_until_ms: int = 0,
        record_draft: str = "",
        settlements: Sequence[SettleCall] = (),
    ) -> AdmitResult:
        """Run ``admit.lua`` over every bucket (reclaiming the tenant's dead reservations),
        after applying ``settlements`` (riders: each settled once, as :meth:`settle_many`
        would; on Cluster each must be in ``ledger``'s slot, see :meth:`rides_with`)."""
        if len(settlements) > MAX_RIDERS:
            raise ValueError(f"at most {MAX_RIDERS} settlements ride on one admission")
        keys: list[str] = []
        args: list[Any] = [len(settlements)]
        for call in settlements:
            _pack_settlement(keys, args, call)
        args += [ledger_ttl_ms, "1" if count_refused else "0", tpm_charged]
        keys += [ledger] + [b.key for b in buckets] + [open_key(ledger)]
        first_bucket = len(args)
        for b in buckets:
            kind = _KIND[b.kind]
            args += [kind, b.amount, b.limit, b.expire_at_ms, b.refundable, int(b.shadow)]
            args += _previous(keys, b)
        args += [now_ms, lease_until_ms, record_draft]
        where = self._owner(ledger)
        res = await self._call(
            "admission", "admit", lambda: self._admit(keys=keys, args=args), slot=where[0]
        )
        status = int(res[0])
        flat = res[2] if len(res) > 2 else []
        settled = res[3] if len(res) > 3 else []
        if self.failover is not None:
            # Journalled whether this answer applied it or found it applied: a duplicate (2)
            # or an already settled rider is this call's own earlier attempt, one that timed
            # out and ran all the same, perhaps on a master about to be replaced.  Replays are
            # idempotent, so a true duplicate costs nothing.
            if status in (1, 2):  # replayed with every bucket shadow: counted, never refused
                replay = list(args)
                for i in range(len(buckets)):
                    replay[first_bucket + 8 * i + 5] = 1
                self._journal("admit", keys, replay, ledger_ttl_ms, where)
            elif settlements:
                self._journal_settlements(settlements, where)
        return AdmitResult(
            admitted=status == 1,
            duplicate=status == 2,
            values=tuple(int(v) for v in res[1]),
            reclaimed=_reclaimed(flat),
            settled=tuple(bool(int(v)) for v in settled),
            allowance_reclaimed=int(res[4]) if len(res) > 4 else 0,
        )

    def rides_with(self, ledger: str) -> Callable[[str], bool]:
        """Which settlements (by ledger) may ride on ``ledger``'s admission: any on a single
        server, those of the same slot on Cluster (one script call runs on one slot)."""
        if not isinstance(self._client, RedisCluster):
            return any_ledger
        slot = key_slot(ledger.encode())
        return lambda other: key_slot(other.encode()) == slot

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
        keys: list[str] = []
        args: list[Any] = [1]
        call = ChargeCall(ledger, seq, buckets, amount, strict, ledger_ttl_ms)
        _pack_charge(keys, args, call)
        give_up = time.monotonic() + self.stream_tolerance_s
        maybe_ran = False
        while True:
            where = self._owner(ledger)
            try:
                res = await self._call(
                    "a stream charge",
                    "charge",
                    lambda: self._charge(keys=keys, args=args),
                    slot=where[0],
                )
                break
            except LimiterUnavailable as exc:
                maybe_ran = maybe_ran or exc.maybe_ran
                left = give_up - time.monotonic()
                if left <= 0:
                    if maybe_ran and not exc.maybe_ran:
                        raise LimiterUnavailable(str(exc), maybe_ran=True) from exc
                    raise
                await asyncio.sleep(min(0.1, left))
        result = _charge_result(res[0])
        self._journal_charge(call, result, where)
        return result

    def _journal_charge(
        self, call: ChargeCall, result: ChargeResult, where: tuple[int, str]
    ) -> None:
        """Journal a stream charge that added tokens, as the lazy charge of what was granted,
        marked a replay ("r": it still applies on a new master that got the request's
        settlement first, charge.lua)."""
        if self.failover is None or result.granted <= 0:
            return
        keys: list[str] = []
        args: list[Any] = [1]
        _pack_charge(
            keys,
            args,
            ChargeCall(
                call.ledger, call.seq, call.buckets, result.granted, False, call.ledger_ttl_ms
            ),
        )
        args[3] = "r"  # [m, seq, amount, strict, ...]
        self._journal("charge", keys, args, call.ledger_ttl_ms, where)

    async def charge_many(self, items: list[ChargeCall]) -> list[ChargeResult | None]:
        """Charge many streams with few ``charge.lua`` calls (grouped as :meth:`settle_many`);
        per item its result, or None when its call failed (retrying it is harmless: each
        charge is idempotent by ledger and sequence number)."""
        out: list[ChargeResult | None] = [None] * len(items)

        async def one(idx: list[int]) -> bool:
            keys: list[str] = []
            args: list[Any] = [len(idx)]
            for i in idx:
                _pack_charge(keys, args, items[i])
            where = self._owner(items[idx[0]].ledger)
            try:
                res = await self._call(
                    "a stream charge",
                    "charge",
                    lambda: self._charge(keys=keys, args=args),
                    slot=where[0],
                )
            except LimiterUnavailable:
                return False
            for i, v in zip(idx, res, strict=True):
                out[i] = result = _charge_result(v)
                self._journal_charge(items[i], result, where)
            return True

        await self._per_slot([c.ledger for c in items], one)
        return out

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
        keys: list[str] = []
        args: list[Any] = [1]
        _pack_settlement(
            keys, args, SettleCall(ledger, adjustments, ledger_ttl_ms, cancel, unconfirmed)
        )
        where = self._owner(ledger)
        res = await self._call(
            "settlement", "settle", lambda: self._settle(keys=keys, args=args), slot=where[0]
        )
        applied = bool(int(res[0]))
        # journalled even when found settled: that may be this settlement's own earlier
        # attempt, which timed out and ran (see :meth:`admit`)
        self._journal("settle", keys, args, ledger_ttl_ms, where)
        return applied

    async def settle_many(self, items: list[SettleCall]) -> list[bool | None]:
        """Settle many requests with few ``settle.lua`` calls: one per Cluster slot (every
        slot on a single server) and per :data:`MAX_ITEMS_PER_CALL`; each item is
        idempotent by its ledger, as with :meth:`settle`.  Per item: True applied, False
        already settled, None its call failed (retrying it is harmless)."""
        out: list[bool | None] = [None] * len(items)

        async def one(idx: list[int]) -> bool:
            keys: list[str] = []
            args: list[Any] = [len(idx)]
            for i in idx:
                _pack_settlement(keys, args, items[i])
            where = self._owner(items[idx[0]].ledger)
            try:
                res = await self._call(
                    "settlement",
                    "settle",
                    lambda: self._settle(keys=keys, args=args),
                    slot=where[0],
                )
            except LimiterUnavailable:
                return False
            for i, v in zip(idx, res, strict=True):
                out[i] = bool(int(v))
            if self.failover is not None:  # every one, applied now or before (see settle)
                self._journal_settlements([items[i] for i in idx], where)
            return True

        await self._per_slot([s.ledger for s in items], one)
        return out

    async def note_inputs(self, notes: list[InputNote]) -> list[bool | None]:
        """Note exact inputs in open ledgers with few ``note.lua`` calls (grouped as
        :meth:`settle_many`); per note True written, False left as it was, None its call
        failed (retrying it is harmless: a ledger takes one note)."""
        out: list[bool | None] = [None] * len(notes)

        async def one(idx: list[int]) -> bool:
            keys: list[str] = []
            args: list[Any] = [len(idx)]
            for i in idx:
                note = notes[i]
                keys.append(note.ledger)
                args += [note.input_tokens, len(note.refund)]
                for key, units in note.refund:
                    args += [key, units]
            try:
                res = await self._call(
                    "an input note", "note", lambda: self._note(keys=keys, args=args)
                )
            except LimiterUnavailable:
                return False
            for i, v in zip(idx, res, strict=True):
                out[i] = bool(int(v))
            return True

        await self._per_slot([n.ledger for n in notes], one)
        return out

    async def stop_input_shortcut(self, key: str, model: str, entry: str, ttl_ms: int) -> bool:
        """``input_stop.lua``: record a model's stopped input shortcut for every replica
        (idempotent: a retry after a timeout changes nothing)."""
        res = await self._call(
            "an input shortcut stop",
            "input_stop",
            lambda: self._input_stop(keys=[key], args=[model, entry, ttl_ms]),
            slot=self._slot(key),
        )
        return bool(int(res))

    async def input_stops(self, key: str) -> list[str]:
        """The models whose input shortcut stopped under this config version (HKEYS)."""
        names = await self._call(
            "the input shortcut stops",
            "input_stops",
            lambda: self._client.hkeys(key),
            slot=self._slot(key),
        )
        return [n.decode() if isinstance(n, bytes) else str(n) for n in names]

    async def take_allowances(
        self, items: list[AllowanceTake], lease: AllowanceLease | None = None
    ) -> list[AllowanceGrant | None]:
        """Take allowances with ``allowance.lua``, one call per Cluster slot (grouped as
        :meth:`settle_many`): per item (granted, value after, ...), None when its call failed.
        Each call carries a fresh id, so a retry after a timeout grants nothing twice; a take
        that granted is journalled and replayed, with its grants, to a new master after a
        failover (the units the replica holds stay counted).  With a ``lease`` (every item of
        the lease ledger's tenant), the grants are recorded in tranches in that ledger."""
        out: list[AllowanceGrant | None] = [None] * len(items)

        async def one(idx: list[int]) -> bool:
            first = items[idx[0]].key
            keys = [call_id_key(first, uuid.uuid4().hex)] + [items[i].key for i in idx]
            args: list[Any] = [RLS_CALL_ID_TTL_MS, "0"]
            for i in idx:
                t = items[i]
                args += [t.want, t.limit, t.expire_at_ms, t.share_ppm, t.least, t.held]
                args.append(t.opened)
            tail: list[Any] = []
            if lease is not None:
                keys += [lease.ledger, open_key(lease.ledger)]
                tail = [lease.now_ms, lease.until_ms, max(lease.tranches, 1), lease.ttl_ms]
            where = self._owner(first)
            try:
                res = await self._call(
                    "an allowance",
                    "allowance",
                    _script_call(self._allowance, keys, args + tail),
                    slot=where[0],
                )
            except LimiterUnavailable:
                return False
            grants, reclaimed, gen = res[0], int(res[1]), _str(res[2])
            drafts = _reclaimed(res[3] if len(res) > 3 else [])
            replay: list[Any] = [RLS_CALL_ID_TTL_MS, "1"]
            for n, (i, v) in enumerate(zip(idx, grants, strict=True)):
                out[i] = AllowanceGrant(
                    int(v[0]),
                    int(v[1]),
                    gen,
                    reclaimed if n == 0 else 0,
                    drafts if n == 0 else (),
                )
                t = items[i]
                replay += [int(v[0]), t.limit, t.expire_at_ms, t.share_ppm, t.least, t.held]
                replay.append(t.opened)
            if any(int(v[0]) > 0 for v in grants):
                self._journal("allowance", keys, replay + tail, RLS_CALL_ID_TTL_MS, where)
            return True

        await self._per_slot([t.key for t in items], one)
        return out

    async def open_tranches(
        self, ledger: str, gen: str, items: list[tuple[str, int]]
    ) -> bool | None:
        """Open allowance tranches with ``tranche.lua`` (one call: every counter of the
        ledger's tenant); journalled like a take, so a new master's record is not left
        higher than what the replica has unopened."""
        if not items:
            return True
        keys = [call_id_key(ledger, uuid.uuid4().hex), ledger] + [k for k, _ in items]
        args: list[Any] = [RLS_CALL_ID_TTL_MS, gen] + [units for _, units in items]
        where = self._owner(ledger)
        try:
            res = await self._call(
                "an allowance tranche",
                "tranche",
                _script_call(self._tranche, keys, args),
                slot=where[0],
            )
        except LimiterUnavailable:
            return None
        if int(res) == 1:
            self._journal("tranche", keys, args, RLS_CALL_ID_TTL_MS, where)
        return int(res) == 1

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
        """``drafts.lua``: keep (request ledger, charged, draft), update (request ledger,
        charged) and drop (request ledger) usage-record drafts in a replica's draft ledger
        ``ledger``, renewing its lease to ``until_ms``; one call, in the ledger's slot.  True
        when the ledger held the earlier drafts, False when it was created anew (the caller
        sends every draft again), None when the call failed (the caller sends it again).
        ``more``: (request ledger, tokens) added to the "charged" of Redis-admitted requests
        whose stream charges were drawn from allowances, while their ledgers are open."""
        keys = [ledger, open_key(ledger)] + [led for led, _ in more]
        args: list[Any] = [until_ms, ttl_ms, len(keep), len(charged), len(drop)]
        for led, amount, draft in keep:
            args += [led, amount, draft]
        for led, amount in charged:
            args += [led, amount]
        args += list(drop)
        args += [n for _, n in more]
        try:
            res = await self._call(
                "usage-record drafts",
                "drafts",
                _script_call(self._drafts, keys, args),
                slot=self._slot(ledger),
            )
        except LimiterUnavailable:
            return None
        return int(res) == 1

    async def _per_slot(
        self, ledgers: list[str], call: Callable[[list[int]], Awaitable[bool]]
    ) -> None:
        """Run ``call`` on the item indexes of each script call: one group per Cluster slot
        (every item on a single server), at most :data:`MAX_ITEMS_PER_CALL` per call.  A
        group's calls run one after another, in item order, and stop at the first that
        fails (a ledger's items must apply in order: a later charge must not run before an
        earlier one that will be retried); different slots run concurrently."""
        groups: dict[int, list[int]] = {}
        cluster = isinstance(self._client, RedisCluster)
        for i, ledger in enumerate(ledgers):
            groups.setdefault(key_slot(ledger.encode()) if cluster else 0, []).append(i)

        async def in_order(idx: list[int]) -> None:
            for start in range(0, len(idx), MAX_ITEMS_PER_CALL):
                if not await call(idx[start : start + MAX_ITEMS_PER_CALL]):
                    return

        if len(groups) == 1:
            await in_order(next(iter(groups.values())))
        elif groups:
            await asyncio.gather(*(in_order(idx) for idx in groups.values()))

    async def renew(
        self, ledgers: list[str], until_ms: int, *, held: dict[str, list[str]] | None = None
    ) -> None:
        """Extend the leases of open reservations and their concurrency slots (ZADD XX: a
        settled one is not re-added)."""
        if not ledgers:
            return

        async def run() -> Any:
            pipe = self._client.pipeline(transaction=False)
            for led in ledgers:
                pipe.zadd(open_key(led), {led: until_ms}, xx=True)
                for slot in (held or {}).get(led, ()):
                    pipe.zadd(slot, {led: until_ms}, xx=True)
                    pipe.pexpireat(slot, until_ms + EXPIRY_SLACK_MS)
            return await pipe.execute()

        await self._call("a lease renewal", "renew", run, slot=self._slot(ledgers[0]))

    async def read(self, keys: list[str]) -> list[int]:
        """MGET the counters (one slot: all keys share a tenant's hash tag)."""
        if not keys:
            return []
        vals = await self._call(
            "a read", "read", lambda: self._client.mget(keys), slot=self._slot(keys[0])
        )
        return [int(v) if v is not None else 0 for v in vals]

    async def count_slots(self, keys: list[str], now_ms: int) -> list[int]:
        """ZCOUNT of each concurrency set over leases still running."""
        if not keys:
            return []

        async def run() -> Any:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.zcount(k, f"({now_ms}", "+inf")
            return await pipe.execute()

        return [int(v) for v in await self._call("a read", "read", run, slot=self._slot(keys[0]))]

    async def ping(self) -> bool:
        """PING, bypassing the breaker."""
        try:
            async with asyncio.timeout(self._timeout):
                return bool(await self._client.ping())
        except _ERRORS:
            return False

    async def close(self) -> None:
        """Close the connection pool."""
        self.lag.stop()
        if self.failover is not None:
            await self.failover.close()
        await self._client.aclose()


def call_id_key(key: str, call_id: str) -> str:
    """A key for ``call_id`` in the Cluster slot of ``key``: ``{<key's hash tag>}:aiq:call:<id>``
    (the whole key stands for the tag when it has none)."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return f"{{{key[start + 1 : end]}}}:aiq:call:{call_id}"
    if "}" in key:  # no valid tag, and the key cannot be one: hash the key itself after it
        raise ValueError(f"cannot place a call id in the slot of {key!r}")
    return f"{{{key}}}:aiq:call:{call_id}"


def _pack_charge(keys: list[str], args: list[Any], c: ChargeCall) -> None:
    """Append one stream charge's KEYS and ARGV slices for ``charge.lua``."""
    keys.append(c.ledger)
    keys += [b.key for b in c.buckets]
    head = len(args)
    args += [c.seq, c.amount, "1" if c.strict else "0", c.ledger_ttl_ms, len(c.buckets), 0]
    first_prev = len(keys)
    for b in c.buckets:
        args += [b.limit, b.expire_at_ms, b.rate, int(b.shadow)]
        args += _previous(keys, b)
    args[head + 5] = len(keys) - first_prev


def _charge_result(v: Any) -> ChargeResult:
    return ChargeResult(
        granted=int(v[0]), exhausted=bool(int(v[1])), values=tuple(int(x) for x in v[2])
    )


def _pack_settlement(keys: list[str], args: list[Any], s: SettleCall) -> None:
    """Append one request's KEYS and ARGV slices for ``settle.lua``."""
    unconfirmed = s.unconfirmed.rates if s.unconfirmed else ()
    keys.append(s.ledger)
    keys.append(open_key(s.ledger))
    args += [
        s.ledger_ttl_ms,
        "1" if s.cancel else "0",
        s.unconfirmed.seq if s.unconfirmed else 0,
        len(s.adjustments),
        len(unconfirmed),
    ]
    for a in s.adjustments:
        keys.append(a.key)
        args += [a.amount, a.expire_at_ms]
    for key, rate in unconfirmed:
        keys.append(key)
        args.append(rate)


def _reclaimed(flat: Sequence[Any]) -> tuple[Reclaimed, ...]:
    """A reclaim's drafts, as the scripts hand them back: (ledger, draft, charged, input)..."""
    return tuple(
        Reclaimed(_str(flat[i]), _str(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3]))
        for i in range(0, len(flat) - 3, 4)
    )


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _previous(keys: list[str], b: BucketCharge) -> list[int]:
    """A sliding bucket's previous-window counter, appended to ``keys``: [its 1-based KEYS
    index, weight]; [0, 0] for a fixed window."""
    if not b.prev_key:
        return [0, 0]
    keys.append(b.prev_key)
    return [len(keys), b.prev_weight]


def _script_call(script: Any, keys: list[str], args: list[Any]) -> Callable[[], Awaitable[Any]]:
    """A call of a registered script with these keys and arguments, made when awaited."""
    return lambda: script(keys=keys, args=args)


def _with_open_s(settings: BreakerSettings, cooldown_ms: int) -> BreakerSettings:
    from dataclasses import replace

    return replace(settings, open_s=cooldown_ms / 1000.0)
