"""Batched settlement (and stream charges): many requests' calls in one Redis call per tick.

Two layers:

- :class:`Backlog`, the decisions without I/O: what to send and when (a tick after the
  first settlement waits, at once while more than a batch is waiting, after a growing backoff
  once a call failed), what a failed call puts back (at the front, in order), whether the
  backlog is full.  Nothing is ever dropped: a full backlog makes the gateway push back on
  admissions (refused, or passed unmetered, per the failure mode) until Redis takes what
  waits, so it cannot grow beyond the requests already in flight.  Time is passed in;
  nothing awaits.
- :class:`Batcher`, the asyncio driver: :meth:`~Batcher.submit` never blocks nor awaits; one
  background task sends the due batch and reports each outcome.  :class:`SettlementBatcher`
  sends through :meth:`extproc.limiter.base.BatchSettler.settle_many`,
  :class:`ChargeBatcher` (lazy stream charges) through
  :meth:`extproc.limiter.base.BatchCharger.charge_many`.

Every settlement is idempotent by its ledger (``settle.lua``), every charge by its ledger and
sequence number (``charge.lua``), so a call that failed after Redis ran it (a timeout) is
simply sent again: the retry answers "already settled" (or the charge's recorded grant) for
what ran, and applies the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import structlog

from extproc.limiter.base import (
    BatchCharger,
    BatchSettler,
    ChargeCall,
    ChargeResult,
    SettleCall,
)

log = structlog.get_logger("extproc")

T = TypeVar("T")
R = TypeVar("R")

#: Seconds the first item waits for others to join its call.
DEFAULT_TICK_S = 0.002
#: Seconds a settlement may wait for an admission to ride on while admissions are flowing
#: (see :attr:`BatchSettings.ride_s`); the gateway's setting.
SETTLEMENT_RIDE_S = 0.020
#: Most settlements sent per batch (the limiter splits it further per Cluster slot and per
#: script call).
DEFAULT_MAX_BATCH = 256
#: Settlements kept while Redis does not take them at which new admissions are pushed back
#: (:attr:`Backlog.full`); none is ever dropped.
DEFAULT_MAX_BACKLOG = 10_000
#: Retry delay after a failed call, doubled per consecutive failure up to the maximum.
DEFAULT_BACKOFF_S = 0.05
DEFAULT_MAX_BACKOFF_S = 2.0


@dataclass(frozen=True, slots=True)
class BatchSettings:
    """How a :class:`Backlog` batches and retries."""

    tick_s: float = DEFAULT_TICK_S
    #: While admissions are flowing (two or more started in the last ``ride_s``) or other
    #: requests are in progress (``busy``), the first item waits ``ride_s`` instead of
    #: ``tick_s``: an admission is then likely to come and carry it at no round trip of its
    #: own (:meth:`Backlog.saw_admission`; 0: never).  Otherwise it goes after ``tick_s``.
    ride_s: float = 0.0
    max_batch: int = DEFAULT_MAX_BATCH
    max_backlog: int = DEFAULT_MAX_BACKLOG
    backoff_s: float = DEFAULT_BACKOFF_S
    max_backoff_s: float = DEFAULT_MAX_BACKOFF_S

    def __post_init__(self) -> None:
        if not self.tick_s >= 0:
            raise ValueError(f"tick_s must be >= 0, got {self.tick_s!r}")
        if not self.ride_s >= 0:
            raise ValueError(f"ride_s must be >= 0, got {self.ride_s!r}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch!r}")
        if self.max_backlog < self.max_batch:
            raise ValueError(
                f"max_backlog ({self.max_backlog}) must be >= max_batch ({self.max_batch})"
            )
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"need 0 < backoff_s ({self.backoff_s}) <= max_backoff_s ({self.max_backoff_s})"
            )


@dataclass(frozen=True, slots=True)
class Outcome(Generic[T, R]):
    """What Redis answered for one item (a settlement: True applied, False already settled;
    a charge: its :class:`~extproc.limiter.base.ChargeResult`)."""

    item: T
    result: R


class Backlog(Generic[T, R]):
    """Waiting items and when to send them (sans-IO: the caller passes the time).

    One batch is in flight at a time: :meth:`take` hands it out, :meth:`finish` takes the
    per-item results back (None for an item whose call failed: it returns to the front)."""

    def __init__(self, settings: BatchSettings | None = None) -> None:
        self.settings = settings or BatchSettings()
        self._waiting: deque[T] = deque()
        self._in_flight: list[T] | None = None
        self._due: float | None = None
        self._failures = 0
        self._riding = 0
        self._admissions = (-math.inf, -math.inf)  # when the last two admissions started

    def __len__(self) -> int:
        """Settlements not yet applied (waiting, in flight, and riding on other calls)."""
        return len(self._waiting) + len(self._in_flight or ()) + self._riding

    @property
    def waiting(self) -> int:
        """Items waiting to be sent (neither in flight nor riding)."""
        return len(self._waiting)

    @property
    def riding(self) -> int:
        """Items handed out by :meth:`steal` and not yet given back."""
        return self._riding

    @property
    def failures(self) -> int:
        """Consecutive failed calls (0 once a call succeeds)."""
        return self._failures

    @property
    def full(self) -> bool:
        """At ``max_backlog`` or beyond: admissions must be pushed back (nothing is dropped;
        the requests in flight may still add theirs)."""
        return len(self) >= self.settings.max_backlog

    def add(self, item: T, now: float, *, busy: bool = False) -> None:
        """Queue ``item`` (always: a full backlog is the admissions' business, see
        :attr:`full`).  ``busy``: other requests are in progress, so an admission is likely
        to come (as when admissions are :meth:`flowing`)."""
        self._waiting.append(item)
        if self._due is None:
            ride = self.settings.ride_s > self.settings.tick_s and (busy or self.flowing(now))
            self._due = now + (self.settings.ride_s if ride else self.settings.tick_s)

    def saw_admission(self, now: float) -> None:
        """An admission call is starting (riders or not): :meth:`flowing` reads when."""
        self._admissions = (self._admissions[1], now)

    def flowing(self, now: float) -> bool:
        """Whether admissions are flowing, so that one will likely carry an item added now
        within ``ride_s``: the last two started within the last ``ride_s``."""
        ride = self.settings.ride_s
        return ride > self.settings.tick_s and now - self._admissions[0] <= ride

    def next_send_at(self) -> float | None:
        """When the next batch is due (None: nothing waits, or a batch is in flight)."""
        if self._in_flight is not None or not self._waiting:
            return None
        return self._due

    def take(self, now: float) -> list[T]:
        """The batch to send now, oldest first (empty when none is due)."""
        due = self.next_send_at()
        if due is None or now < due:
            return []
        n = min(self.settings.max_batch, len(self._waiting))
        batch = [self._waiting.popleft() for _ in range(n)]
        self._in_flight = batch
        self._due = None
        return batch

    def finish(self, results: Sequence[R | None], now: float) -> list[Outcome[T, R]]:
        """Results of the in-flight batch (one per item, in order, None where the call
        failed); returns what Redis took.  Failed items go back to the front in their order
        and wait a backoff."""
        batch = self._in_flight
        if batch is None:
            raise RuntimeError("finish() without a batch in flight")
        if len(results) != len(batch):
            raise ValueError(f"{len(results)} results for a batch of {len(batch)}")
        self._in_flight = None
        done = [Outcome(s, r) for s, r in zip(batch, results, strict=True) if r is not None]
        failed = [s for s, r in zip(batch, results, strict=True) if r is None]
        if failed:
            self._waiting.extendleft(reversed(failed))
            self._failures += 1
            delay = self.settings.backoff_s * 2 ** (self._failures - 1)
            self._due = now + min(delay, self.settings.max_backoff_s)
        else:
            self._failures = 0
            # what arrived while this batch was in flight has waited a call already: at once
            self._due = now if self._waiting else None
        return done

    def fail(self, now: float) -> None:
        """The in-flight call raised: every item of it is retried."""
        if self._in_flight is not None:
            self.finish([None] * len(self._in_flight), now)

    def steal(self, fits: Callable[[T], bool], limit: int, *, scan: int | None = None) -> list[T]:
        """Remove up to ``limit`` waiting items (never in-flight ones) for which ``fits`` is
        true, oldest first, to ride on another call; ``scan`` bounds how many waiting items
        are looked at (None: all).  They count in ``len()`` until :meth:`ridden` gives them
        back."""
        if limit <= 0 or not self._waiting:
            return []
        taken: list[T] = []
        kept: list[T] = []
        looked = 0
        while self._waiting and len(taken) < limit and (scan is None or looked < scan):
            item = self._waiting.popleft()
            looked += 1
            (taken if fits(item) else kept).append(item)
        self._waiting.extendleft(reversed(kept))
        self._riding += len(taken)
        if not self._waiting and not self._failures:
            self._due = None  # nothing left to send; a backoff stays in force
        return taken

    def ridden(
        self, items: Sequence[T], results: Sequence[R | None], now: float
    ) -> list[Outcome[T, R]]:
        """Stolen items come back with their results (None: their call failed, or did not
        answer for them): the taken ones are returned as outcomes, the others go back to the
        front of the queue, in order, and are due at once (the tick they waited is over;
        a backoff in force stays)."""
        if len(results) != len(items):
            raise ValueError(f"{len(results)} results for {len(items)} riders")
        if len(items) > self._riding:
            raise RuntimeError(f"{len(items)} riders back, {self._riding} out")
        self._riding -= len(items)
        done = [Outcome(s, r) for s, r in zip(items, results, strict=True) if r is not None]
        failed = [s for s, r in zip(items, results, strict=True) if r is None]
        if failed:
            self._waiting.extendleft(reversed(failed))
            if self._due is None or (not self._failures and self._due > now):
                self._due = now
        return done

    def hurry(self, now: float) -> None:
        """Make what waits due now (shutting down: no tick to wait for; a backoff in force
        stays)."""
        if self._waiting and not self._failures and (self._due is None or self._due > now):
            self._due = now

    def drain(self) -> list[T]:
        """Everything not applied (waiting and in flight), removed."""
        left = [*(self._in_flight or ()), *self._waiting]
        self._waiting.clear()
        self._in_flight = None
        self._due = None
        return left


class Batcher(Generic[T, R]):
    """Sends queued items in batches from one background task (asyncio driver of
    :class:`Backlog`); ``send(batch)`` answers per item (None: not taken, retry).

    ``on_result(outcome)`` runs for every item Redis took, on the event loop (it must not
    block).  ``what`` names the items in log events (``settlement_batch_deferred``...)."""

    def __init__(
        self,
        send: Callable[[list[T]], Awaitable[list[R | None]]],
        settings: BatchSettings | None = None,
        *,
        on_result: Callable[[Outcome[T, R]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        what: str = "item",
    ) -> None:
        self.send = send
        self.backlog: Backlog[T, R] = Backlog(settings)
        self.on_result = on_result
        self.what = what
        self.clock = clock
        self.calls = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._out: list[list[T]] = []  # riders handed out, not yet back
        self._sooner = asyncio.Event()

    def __len__(self) -> int:
        return len(self.backlog)

    def submit(self, item: T, *, busy: bool = False) -> None:
        """Queue an item (never blocks; starts the sender task on first use); ``busy`` as
        :meth:`Backlog.add` takes it."""
        if self._closed:
            raise RuntimeError(f"the {self.what} batcher is closed")
        self.backlog.add(item, self.clock(), busy=busy)
        self._idle.clear()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            due = self.backlog.next_send_at()
            if due is None:
                if not len(self.backlog):
                    self._idle.set()
                    if self._closed:
                        return
                self._wake.clear()
                await self._wake.wait()
                continue
            delay = due - self.clock()
            if delay > 0:
                # riders put back may make a batch due sooner: they cut the wait short
                self._sooner.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._sooner.wait()
            batch = self.backlog.take(self.clock())
            if not batch:
                continue
            await self._send(batch)

    async def _send(self, batch: list[T]) -> None:
        self.calls += 1
        try:
            results = await self.send(batch)
        except asyncio.CancelledError:
            self.backlog.fail(self.clock())
            raise
        except Exception:
            log.exception(f"{self.what}_batch_failed", size=len(batch))
            self.backlog.fail(self.clock())
            return
        failures = self.backlog.failures
        done = self.backlog.finish(results, self.clock())
        if self.backlog.failures > failures:
            log.warning(
                f"{self.what}_batch_deferred",
                failed=len(batch) - len(done),
                backlog=len(self.backlog),
                retry_in_s=round((self.backlog.next_send_at() or 0) - self.clock(), 3),
            )
        elif failures:
            log.info(f"{self.what}_batch_recovered", backlog=len(self.backlog))
        self._report(done)

    def _report(self, done: list[Outcome[T, R]]) -> None:
        if self.on_result is not None:
            for outcome in done:
                try:
                    self.on_result(outcome)
                except Exception:
                    log.exception(
                        f"{self.what}_callback_failed", ledger=getattr(outcome.item, "ledger", None)
                    )

    def saw_admission(self) -> None:
        """An admission call is starting (see :meth:`Backlog.saw_admission`)."""
        self.backlog.saw_admission(self.clock())

    def take_riders(self, fits: Callable[[T], bool], limit: int) -> list[T]:
        """Waiting items (up to ``limit``, those ``fits`` accepts) to send on another call
        that happens anyway; :meth:`riders_back` must follow, whatever that call's fate.
        None after :meth:`close`."""
        if self._closed:
            return []
        riders = self.backlog.steal(fits, limit, scan=self.backlog.settings.max_batch)
        if riders:
            self._out.append(riders)
        return riders

    def riders_back(self, riders: list[T], results: Sequence[R | None] | None) -> None:
        """What the call answered for the riders (None: the call failed): the taken ones are
        reported through ``on_result`` as batched ones are, the others wait for the next
        batch (at once)."""
        if not riders:
            return
        for i, group in enumerate(self._out):
            if group is riders:
                del self._out[i]
                break
        else:
            raise RuntimeError(f"{len(riders)} {self.what}s came back that were not riding")
        if results is None or len(results) != len(riders):
            results = [None] * len(riders)
        done = self.backlog.ridden(riders, results, self.clock())
        self._report(done)
        if not len(self.backlog):
            self._idle.set()
        else:
            self._wake.set()
            self._sooner.set()
            if not self._closed and (self._task is None or self._task.done()):
                self._task = asyncio.ensure_future(self._run())

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every submitted item was taken by Redis; False on timeout."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def close(self, grace_s: float) -> list[T]:
        """Stop taking items, keep sending for up to ``grace_s`` seconds, and return what
        Redis still has not taken (the caller logs it), riders whose call has not answered
        yet included."""
        self._closed = True
        self.backlog.hurry(self.clock())
        self._wake.set()
        self._sooner.set()
        if len(self.backlog):
            await self.wait_idle(grace_s)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return self.backlog.drain() + [r for group in self._out for r in group]


class SettlementBatcher(Batcher[SettleCall, bool]):
    """Settlements, many per ``settle.lua`` call: ``on_result`` gets True (applied) or
    False (already settled) per settlement."""

    def __init__(
        self,
        settler: BatchSettler,
        settings: BatchSettings | None = None,
        *,
        on_result: Callable[[Outcome[SettleCall, bool]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            settler.settle_many,
            settings,
            on_result=on_result,
            clock=clock,
            what="settlement",
        )


class ChargeBatcher(Batcher[ChargeCall, ChargeResult]):
    """Lazy stream charges, many per ``charge.lua`` call: ``on_result`` gets each charge's
    :class:`~extproc.limiter.base.ChargeResult` (``exhausted``: cut the stream).  Strict
    charges gate delivery and stay synchronous (:meth:`Limiter.charge`)."""

    def __init__(
        self,
        charger: BatchCharger,
        settings: BatchSettings | None = None,
        *,
        on_result: Callable[[Outcome[ChargeCall, ChargeResult]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            charger.charge_many,
            settings,
            on_result=on_result,
            clock=clock,
            what="charge",
        )
