"""Calling Redis: every script call of the limiter and of the RLS counter goes through one
:class:`RedisCaller` (they compose it), which bounds it, retries it, breaks the circuit and
rides out a failover.  Any Redis failure becomes :class:`extproc.errors.LimiterUnavailable`;
how long that can take:

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

Before a call, a master that may have changed gets the journal of acknowledged calls replayed
(:mod:`extproc.limiter.failover`); after one, the caller journals what must survive a failover
(:meth:`RedisCaller.journal`, in the replay form its packer laid out).  :meth:`RedisCaller.batched`
is the one way to send many items: one call per Cluster slot and per
:data:`MAX_ITEMS_PER_CALL`.  Timeouts, the pool and the breaker can be changed live
(:meth:`RedisCaller.configure`, SIGHUP reload).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from extproc.clock import Clock, SystemClock
from extproc.errors import LimiterUnavailable
from extproc.limiter.breaker import BreakerSettings, BreakerState, CircuitBreaker
from extproc.limiter.failover import Failover
from extproc.limiter.journal import DEFAULT_WINDOW_S, Journal
from extproc.limiter.layout import Packed
from extproc.limiter.scripts import load_script
from extproc.limiter.starvation import LoopLag, fair_wait

if TYPE_CHECKING:
    from extproc.metrics import Metrics

T = TypeVar("T")
R = TypeVar("R")

#: (Cluster slot, run id of its master as known when the call was sent) of a call.
Where = tuple[int, str]

_ERRORS = (
    redis.exceptions.RedisError,
    ConnectionError,
    OSError,
    TimeoutError,
    asyncio.TimeoutError,
)

#: How many times a call that found its script missing is sent again at once.  NOSCRIPT is not
#: ambiguous (the script never ran), and redis-py's ``Script`` loads the script at the first
#: one and sends the call again; a second comes only when the script was flushed again in
#: between (a SCRIPT FLUSH racing the load, a second failover): sending again is safe.
NOSCRIPT_RESENDS = 3

#: Most settlements or charges in one script call (a script blocks Redis while it runs: 64
#: settlements take well under a millisecond).
MAX_ITEMS_PER_CALL = 64

#: Default of :attr:`RedisCaller.failover_wait_s` for a limiter built directly (the served
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


def with_open_s(settings: BreakerSettings, cooldown_ms: int) -> BreakerSettings:
    """``settings`` with the breaker's open time set to ``cooldown_ms``."""
    return replace(settings, open_s=cooldown_ms / 1000.0)


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError | asyncio.TimeoutError | redis.exceptions.TimeoutError)


class RedisCaller:
    """Calls to one Redis (single server, Sentinel master or Cluster), bounded and journalled."""

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
        failover_wait_s: float = DEFAULT_FAILOVER_WAIT_S,
        monotonic: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self.clock: Clock = clock or SystemClock()
        #: the time a call waits in (failover wait, journal), real even when ``clock`` (the
        #: breaker's) is a test's frozen one; and the metrics' call durations
        self.monotonic = monotonic
        self._timer = timer
        #: how long a call that finds Redis unavailable is sent again before it fails (a
        #: replica's promotion or a restart shorter than this fails nothing; 0: at once)
        self.failover_wait_s = failover_wait_s
        #: calls that found Redis unavailable and waited (were sent again), and of those the
        #: ones that failed all the same past the bound
        self.waited_calls = 0
        self.waits_exhausted = 0
        self._timeout = timeout_ms / 1000.0
        self.lag = LoopLag()
        base = breaker or BreakerSettings()
        self.breaker = CircuitBreaker(
            self.clock, with_open_s(base, cooldown_ms) if breaker is None else base
        )
        self.stall_retries = stall_retries
        self.metrics = metrics
        self.round_trips = 0
        #: every registered script by name (a journalled call's replay runs it again)
        self.scripts: dict[str, Any] = {}
        self.export_state()
        # Redis HA: acknowledged charges kept journal_s seconds and replayed to a new master
        # (extproc.limiter.failover); 0 turns it off.
        self.failover: Failover | None = None
        if journal_s > 0:
            self.failover = Failover(
                client,
                self.scripts,
                Journal(window_s=journal_s),
                metrics=metrics,
                on_recovered=self._recovered,
                lag=self.lag,
                monotonic=monotonic,
            )

    def register(self, name: str) -> Any:
        """The packaged script ``name``, registered on the client once (for :meth:`run` and
        for a replay of what :meth:`journal` keeps)."""
        script = self.scripts.get(name)
        if script is None:
            script = self.scripts[name] = self.client.register_script(load_script(name))
        return script

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
        """Apply failure settings to the running caller (SIGHUP reload).

        The per-attempt bound applies to the next call, and so do the pool's wait for a free
        connection and the sockets' own timeouts (pooled connections are updated in place).
        """
        if timeout_ms is not None:
            self._timeout = timeout_ms / 1000.0
            ceiling = starved_ceiling_s(self._timeout)
            pool = getattr(self.client, "connection_pool", None)
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
            settings = with_open_s(settings, cooldown_ms)
        if settings != self.breaker.settings:
            self.breaker.configure(settings)

    # -- state -------------------------------------------------------------------------------

    def pool_in_use(self) -> int:
        """Connections checked out of the single-server pool now (0 for Cluster)."""
        pool = getattr(self.client, "connection_pool", None)
        in_use = getattr(pool, "_in_use_connections", None)
        return len(in_use) if in_use is not None else 0

    def export_state(self) -> None:
        """The breaker's state and the pool's use, to the metrics."""
        m = self.metrics
        if m is not None:
            m.breaker_state.set(int(self.breaker.state))
            m.redis_pool_in_use.set(self.pool_in_use())

    def _observe(self, script: str, outcome: str, started: float) -> None:
        m = self.metrics
        if m is not None:
            m.redis_seconds.labels(script, outcome).observe(self._timer() - started)

    def slot(self, key: str) -> int:
        """The Cluster slot of ``key`` (0 on a single server)."""
        return key_slot(key.encode()) if self.cluster else 0

    def owner(self, key: str) -> Where:
        """(slot, run id of its master as known now) of a call about to be sent on ``key``."""
        slot = self.slot(key)
        return slot, (self.failover.owner(slot) if self.failover is not None else "")

    # -- calls -------------------------------------------------------------------------------

    async def call(
        self,
        what: str,
        script: str,
        make: Callable[[], Awaitable[T]],
        *,
        retry: bool = True,
        slot: int = 0,
    ) -> T:
        """Run ``make()`` against Redis under the timeout, the stall retry (``retry``: the
        call is idempotent), the breaker and the failover wait; ``what`` names the call in
        the error, ``script`` in the metrics."""
        attempt = 0
        waited = 0
        first = self.monotonic()
        maybe_ran = False  # an attempt timed out: Redis may still run it when it wakes up
        noscript = 0
        while True:
            started = self._timer()
            if not self.breaker.allow():
                self._observe(script, "breaker", started)
                self.export_state()
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
            except redis.exceptions.NoScriptError:
                # Redis answered, and the script did not run: no outcome for the breaker (its
                # half-open probe, if this call was one, is given back)
                self.breaker.abandon()
                if noscript < NOSCRIPT_RESENDS:
                    noscript += 1
                    self._observe(script, "noscript", started)
                    continue
                self._observe(script, "error", started)
                raise LimiterUnavailable(
                    f"the quota backend (Redis) kept losing the script of {what} "
                    "(SCRIPT FLUSH in a loop?)"
                ) from None
            except _ERRORS as exc:
                if self.failover is not None:
                    self.failover.failed()
                timed_out = _is_timeout(exc)
                maybe_ran = maybe_ran or timed_out
                self._observe(script, "timeout" if timed_out else "error", started)
                self.breaker.record(False)
                self.export_state()
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
            self.export_state()
            return result

    def run(self, what: str, name: str, packed: Packed, where: Where) -> Awaitable[Any]:
        """Run registered script ``name`` with ``packed`` in ``where``'s slot (:meth:`call`:
        the call must be idempotent); awaited by the caller (no coroutine of its own)."""
        script = self.scripts[name]
        keys, args = packed.keys, packed.args
        return self.call(what, name, lambda: script(keys=keys, args=args), slot=where[0])

    async def _wait(self, first: float, waited: int) -> bool:
        """Pause before sending a call again that found Redis unavailable, when its
        :attr:`failover_wait_s` bound allows (False: it fails now)."""
        pause = failover_pause(waited)
        if not may_wait(self.monotonic() - first, pause, self.failover_wait_s):
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
            self.export_state()

    def journal(self, name: str, packed: Packed, ttl_ms: int, where: Where) -> None:
        """Keep an acknowledged call of script ``name`` for a replay to a new master, in the
        form it must be replayed with (it must count nothing twice)."""
        if self.failover is not None:
            self.failover.record(
                name, packed.keys, packed.args, ttl_ms, slot=where[0], owner=where[1]
            )

    @property
    def journals(self) -> bool:
        """Whether acknowledged calls are journalled (Redis HA is on)."""
        return self.failover is not None

    # -- many items --------------------------------------------------------------------------

    async def batched(
        self,
        what: str,
        name: str,
        firsts: Sequence[str],
        pack: Callable[[list[int]], Packed],
        read: Callable[[list[int], Any, Where], Sequence[R]],
    ) -> list[R | None]:
        """Send items with few calls of script ``name``: ``firsts[i]``, the key whose slot
        item ``i`` goes to; ``pack(indexes)``, one call's arguments; ``read(indexes, answer,
        where)``, its items' results (journalling what it must).  Per item its result, None
        when its call failed (Redis unavailable: sending it again is harmless)."""
        out: list[R | None] = [None] * len(firsts)

        async def one(idx: list[int]) -> bool:
            packed = pack(idx)
            where = self.owner(firsts[idx[0]])
            try:
                res = await self.run(what, name, packed, where)
            except LimiterUnavailable:
                return False
            for i, r in zip(idx, read(idx, res, where), strict=True):
                out[i] = r
            return True

        await self.per_slot(firsts, one)
        return out

    async def per_slot(
        self, keys: Sequence[str], call: Callable[[list[int]], Awaitable[bool]]
    ) -> None:
        """Run ``call`` on the item indexes of each script call: one group per Cluster slot
        (every item on a single server), at most :data:`MAX_ITEMS_PER_CALL` per call.  A
        group's calls run one after another, in item order, and stop at the first that
        fails (a ledger's items must apply in order: a later charge must not run before an
        earlier one that will be retried); different slots run concurrently."""
        groups: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(self.slot(key), []).append(i)

        async def in_order(idx: list[int]) -> None:
            for start in range(0, len(idx), MAX_ITEMS_PER_CALL):
                if not await call(idx[start : start + MAX_ITEMS_PER_CALL]):
                    return

        if len(groups) == 1:
            await in_order(next(iter(groups.values())))
        elif groups:
            await asyncio.gather(*(in_order(idx) for idx in groups.values()))

    # -- the connection ----------------------------------------------------------------------

    async def ping(self) -> bool:
        """PING, bypassing the breaker."""
        try:
            async with asyncio.timeout(self._timeout):
                return bool(await self.client.ping())
        except _ERRORS:
            return False

    async def close(self) -> None:
        """Stop the watch and the lag timer, close the connection pool."""
        self.lag.stop()
        if self.failover is not None:
            await self.failover.close()
        await self.client.aclose()
