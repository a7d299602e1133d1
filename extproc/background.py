"""What runs beside the requests of one process, in the background (:class:`Background`): the
settlements on their way to Redis (batched, riding on admissions, kept after a failure), the
renewal of open reservations' leases, the input shortcut's stops shared with the other replicas
through Redis (:class:`InputStops`), the exact input counts of requests admitted on a bound on
their way to their open ledgers (:class:`InputNotes`), the tasks to drain at shutdown.

The :class:`~extproc.gateway.Gateway` (what serving one request needs) composes one and is its
:class:`Host`: these jobs read its limiter, rules and metrics; a request only hands them work (a
settlement, a stop found, a note) and never waits for them."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol, cast

import orjson
import structlog

from extproc.clock import Clock
from extproc.config.runtime import RuntimeConfig
from extproc.core.audits import InputAudits
from extproc.core.keys import input_stops_key
from extproc.errors import LimiterUnavailable
from extproc.limiter.base import (
    MAX_RIDERS,
    AdmitResult,
    InputNote,
    InputNoter,
    InputStopStore,
    Limiter,
    SettleCall,
)
from extproc.limiter.batch import SETTLEMENT_RIDE_S, BatchSettings, Outcome, SettlementBatcher
from extproc.limiter.kept import SettlementQueue
from extproc.metrics import Metrics

log = structlog.get_logger("extproc")

#: How often each replica reads the models whose input shortcut another replica stopped (one
#: HKEYS of one small hash per replica per period, off the requests' path), and writes the
#: stops it found that Redis did not take yet.
INPUT_STOPS_REFRESH_S = 1.0
#: How long a config version's stops live in Redis after the last one was found (a version
#: no replica runs any more is forgotten).
INPUT_STOPS_TTL_MS = 30 * 86_400_000

#: Input notes waiting for their call at most (beyond, a note is dropped: the bound stays).
MAX_INPUT_NOTES = 10_000
#: How long a note waits for others to share its call.
INPUT_NOTE_TICK_S = 0.005


class OpenRequest(Protocol):
    """A request in flight, as the shared registry sees it."""

    @property
    def open_lease(self) -> tuple[str, list[str]] | None:
        """(ledger, concurrency sets holding it) while its reservation is open, else None."""
        ...

    async def cut_for_shutdown(self) -> bool:
        """Cut a running stream with ``server_shutdown``; True when one was cut."""
        ...


class Host(Protocol):
    """What the background jobs read of their owner (the process's
    :class:`~extproc.gateway.Gateway`): its rules may be swapped at any time."""

    limiter: Limiter
    config: RuntimeConfig
    config_version: str
    clock: Clock
    metrics: Metrics
    key_prefix: str
    instance: str
    input_audits: InputAudits
    active: set[OpenRequest]


class InputStops:
    """The input shortcut's stops, shared by every replica through Redis."""

    __slots__ = ("_gw", "_loop", "_seen", "_track", "_unsent")

    def __init__(self, gw: Host, track: Callable[[asyncio.Task[Any]], None]) -> None:
        self._gw = gw
        self._track = track  # keeps a write alive until it ends (drained at shutdown)
        # stops found here that Redis has not taken yet: (config version, model) -> what was found
        self._unsent: dict[tuple[str, str], str] = {}
        # writes them and reads the other replicas' every INPUT_STOPS_REFRESH_S while requests
        # are admitted on a bound (an idle replica makes no call)
        self._loop: asyncio.Task[None] | None = None
        self._seen = False

    def bound_seen(self) -> None:
        """A request was admitted on a bound: keep the shared stops fresh."""
        self._seen = True
        if self._loop is None:
            self.keep()

    def _store(self) -> InputStopStore | None:
        if getattr(self._gw.limiter, "input_stops", None) is None:
            return None
        return cast("InputStopStore", self._gw.limiter)

    def stop(self, model: str, found: dict[str, Any]) -> None:
        """A count here contradicted ``model``'s upstream input figure (the shortcut already
        stopped in this process): write it to Redis for every replica, at once in the
        background, and again at each refresh until Redis takes it."""
        version = self._gw.config_version
        entry = {
            **found,
            "model": model,
            "config_version": version,
            "replica": self._gw.instance,
            "at_ms": self._gw.clock.now_ms(),
        }
        self._unsent[(version, model)] = orjson.dumps(entry).decode()
        if self._store() is not None:
            self._track(asyncio.ensure_future(self._write()))
            self.keep()  # retries what Redis did not take

    async def _write(self) -> None:
        store = self._store()
        if store is None:
            return
        for (version, model), entry in list(self._unsent.items()):
            key = input_stops_key(self._gw.key_prefix, version)
            try:
                first = await store.stop_input_shortcut(key, model, entry, INPUT_STOPS_TTL_MS)
            except LimiterUnavailable:
                log.warning("input_shortcut_stop_not_written", model=model, retry_in_s=1.0)
                return
            self._unsent.pop((version, model), None)
            log.info("input_shortcut_stop_written", model=model, first=first)

    async def refresh(self) -> list[str]:
        """Write the stops found here that Redis did not take yet, then read those of this
        config version (any replica's, this one's before a restart): the models this stopped
        here now.  One HKEYS; a Redis that does not answer changes nothing (the probation and
        this process's own audits still hold)."""
        store = self._store()
        if store is None:
            return []
        if self._unsent:
            await self._write()
        version = self._gw.config_version
        try:
            names = await store.input_stops(input_stops_key(self._gw.key_prefix, version))
        except LimiterUnavailable:
            return []
        if version != self._gw.config_version:
            return []  # the rules changed meanwhile: these stops belong to the old version
        models = self._gw.config.models  # labels and the table: configured models only
        new = self._gw.input_audits.stopped_elsewhere(n for n in names if n in models)
        for model in new:
            self._gw.metrics.input_stops_adopted.labels(model).inc()
            log.warning(
                "input_shortcut_stopped_elsewhere",
                model=model,
                config_version=version,
                note="another replica's count contradicted this model's upstream input figure",
            )
        return new

    def keep(self) -> None:
        """Start the refresh of the shared stops (once per process, with the first request
        admitted on a bound or the first stop found here): at once, then every
        :data:`INPUT_STOPS_REFRESH_S` in which a request was admitted on a bound or a stop
        waits to be written.  An idle replica makes no call; a model's first requests after a
        start are counted until one agrees (its probation), so the first read is never late."""
        if self._store() is None:
            return
        if self._loop is None or self._loop.done():
            loop = asyncio.get_running_loop()
            self._loop = loop.create_task(self._refresh_loop(), context=contextvars.Context())

    async def _refresh_loop(self) -> None:
        while True:
            if self._seen or self._unsent:
                self._seen = False
                try:
                    await self.refresh()
                except Exception:  # never let the loop die: the next period tries again
                    log.exception("input_stops_refresh_failed")
            await asyncio.sleep(INPUT_STOPS_REFRESH_S)

    async def close(self) -> None:
        """Stop the refresh; write what is still unsent, once."""
        task = self._loop
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._unsent:
            await self._write()


class InputNotes:
    """Exact input counts of requests admitted on a bound, on their way to their open ledgers
    (so that a reclaim after a SIGKILL refunds the rest of the bound), a few per Redis call."""

    __slots__ = ("_gw", "_queue", "_task")

    def __init__(self, gw: Host) -> None:
        self._gw = gw
        self._queue: list[InputNote] = []
        self._task: asyncio.Task[None] | None = None

    def note(self, note: InputNote) -> None:
        """Write a request's exact input into its open ledger, in the background (a few
        milliseconds, many notes per call).  A note that cannot be written (no room in the
        queue, Redis failing) leaves the bound in the ledger: a SIGKILL then bills it, the
        over-count it was before; the request's own settlement is not affected."""
        if getattr(self._gw.limiter, "note_inputs", None) is None:
            return
        if len(self._queue) >= MAX_INPUT_NOTES:
            self._gw.metrics.input_notes.labels("dropped").inc()
            return
        self._queue.append(note)
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._write(), context=contextvars.Context())

    async def _write(self) -> None:
        while self._queue:
            await asyncio.sleep(INPUT_NOTE_TICK_S)  # others join the call
            notes, self._queue = self._queue, []
            noter: InputNoter = cast("InputNoter", self._gw.limiter)
            results = await noter.note_inputs(notes)
            for r in results:
                self._gw.metrics.input_notes.labels(
                    "written" if r else "failed" if r is None else "closed"
                ).inc()


class Background:
    """The background part of one process, composed by its :class:`~extproc.gateway.Gateway`:
    the settlement pipeline, lease renewal, the input shortcut's stops and notes, the tasks
    to drain.  Requests hand it work; the app drains and closes it at shutdown."""

    def __init__(self, gw: Host, batch_settings: BatchSettings | None = None) -> None:
        self._gw = gw
        self.pending: set[asyncio.Task[Any]] = set()
        # How the settlement batcher batches: a settlement waits a tick (2 ms) for others to
        # share its call, or, while admissions are flowing, up to ``ride_s`` for one to ride on
        self.batch_settings = batch_settings or BatchSettings(ride_s=SETTLEMENT_RIDE_S)
        # Settlements that failed, kept until Redis answers again (made on first use)
        self._settlements: SettlementQueue | None = None
        # Settlements go to Redis many per call, from one task (when the limiter can)
        self._batcher: SettlementBatcher | None = None
        # Open reservations are leased (``failure.reservation_lease_seconds``) and renewed
        # every third of it while their request runs; a processor that dies stops renewing,
        # and the tenant's next admission refunds what it had reserved (the bound on what a
        # SIGKILL leaks).
        self._leases: asyncio.Task[None] | None = None
        self.stops = InputStops(gw, self.track)
        self.notes = InputNotes(gw)

    # -- tasks ------------------------------------------------------------------------------

    def track(self, task: asyncio.Task[Any]) -> None:
        """Keep a background task alive until it ends (settlements are drained on shutdown)."""
        self.pending.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background_task_failed", error=repr(task.exception()))

    # -- the input shortcut -----------------------------------------------------------------

    def stop_input_shortcut(self, model: str, found: dict[str, Any]) -> None:
        """A count here contradicted ``model``'s upstream input figure: tell every replica
        (:meth:`InputStops.stop`)."""
        self.stops.stop(model, found)

    def note_input(self, note: InputNote) -> None:
        """Write a request's exact input into its open ledger, in the background
        (:meth:`InputNotes.note`)."""
        self.notes.note(note)

    # -- settlements ------------------------------------------------------------------------

    @property
    def settlements(self) -> SettlementQueue:
        """Settlements that failed, kept until Redis answers again."""
        if self._settlements is None:
            self._settlements = SettlementQueue(self._gw.limiter, self._gw.metrics)
        return self._settlements

    @property
    def settle_batcher(self) -> SettlementBatcher | None:
        """The settlement batcher, when the limiter settles many per call (started lazily,
        in a context of its own)."""
        if self._batcher is None:
            if not hasattr(self._gw.limiter, "settle_many"):
                return None
            self._batcher = SettlementBatcher(
                self._gw.limiter,  # type: ignore[arg-type]
                self.batch_settings,
                on_result=self._settled,
            )
        return self._batcher

    def submit_settlement(self, call: SettleCall) -> None:
        """Queue a settlement for the next batch (never blocks), in the batcher's own context.
        With other requests in progress here it waits for an admission to ride on (up to
        the batcher's ``ride_s``)."""
        batcher = self.settle_batcher
        assert batcher is not None
        busy = len(self._gw.active) > 1  # the settling request may still be one of them
        contextvars.Context().run(partial(batcher.submit, call, busy=busy))
        self._gw.metrics.settlement_backlog.set(len(batcher))

    def riders_for(self, ledger: str) -> list[SettleCall]:
        """Waiting settlements that can ride on ``ledger``'s admission call (same Cluster
        slot), taken out of the batcher: :meth:`riders_done` must follow, whatever the
        call's fate.  Empty when none waits or the limiter cannot carry them."""
        batcher = self._batcher
        if batcher is None:
            return []
        batcher.saw_admission()
        if not batcher.backlog.waiting:
            return []
        rides_with = getattr(self._gw.limiter, "rides_with", None)
        if rides_with is None:
            return []
        fits = rides_with(ledger)
        return batcher.take_riders(lambda c: fits(c.ledger), MAX_RIDERS)

    def riders_done(self, riders: list[SettleCall], res: AdmitResult | None) -> None:
        """The admission that carried ``riders`` answered ``res`` (None: it failed): the
        applied ones are counted as batched ones are, the others go back to the batcher."""
        batcher = self._batcher
        if not riders or batcher is None:
            return
        batcher.riders_back(riders, res.settled if res is not None else None)
        self._gw.metrics.settlement_backlog.set(len(batcher))

    def _settled(self, outcome: Outcome[SettleCall, bool]) -> None:
        metrics = self._gw.metrics
        if outcome.result:
            metrics.settlements.labels("applied").inc()
        else:  # our own retried call found it applied (it never applies twice)
            metrics.duplicate_hits.labels("settle").inc()
        if self._batcher is not None:
            metrics.settlement_backlog.set(len(self._batcher))

    def settlements_full(self) -> bool:
        """Whether the settlements waiting for Redis (batched, and kept after a failure)
        reached the batcher's ``max_backlog``: admissions are then pushed back, so that no
        settlement is ever dropped (the requests in flight still add theirs)."""
        waiting = len(self._batcher) if self._batcher is not None else 0
        kept = len(self._settlements) if self._settlements is not None else 0
        return waiting + kept >= self.batch_settings.max_backlog

    # -- leases -----------------------------------------------------------------------------

    def keep_leases(self) -> None:
        """Start renewing open reservations' leases (once per process)."""
        if self._leases is None or self._leases.done():
            # Its own (empty) context: it outlives the request whose admission started it, and
            # must not log with that request's bound fields.
            loop = asyncio.get_running_loop()
            self._leases = loop.create_task(self._renew_loop(), context=contextvars.Context())

    def open_leases(self) -> dict[str, list[str]]:
        """Ledgers of requests admitted here and not yet settled, each with the concurrency
        sets holding it (renewed together)."""
        held: dict[str, list[str]] = {}
        for p in list(self._gw.active):
            lease = p.open_lease
            if lease is not None:
                held[lease[0]] = lease[1]
        return held

    async def _renew_loop(self) -> None:
        gw = self._gw
        while True:
            lease_ms = gw.config.reservation_lease_ms
            await asyncio.sleep(lease_ms / 3000)
            held = self.open_leases()
            if not held:
                continue
            try:
                await gw.limiter.renew(list(held), gw.clock.now_ms() + lease_ms, held=held)
            except LimiterUnavailable:
                log.warning("lease_renewal_failed", open=len(held))

    # -- shutdown ---------------------------------------------------------------------------

    async def cut_streams_for_shutdown(self) -> int:
        """End every stream still open with a well-formed ``server_shutdown`` error; how many."""
        n = 0
        for proc in list(self._gw.active):
            if await proc.cut_for_shutdown():
                n += 1
        return n

    async def drain_settlements(self, grace_s: float) -> None:
        """Wait for in-flight settlements, then retry the kept ones once more."""
        if self.pending:
            await asyncio.wait(list(self.pending), timeout=grace_s)
        if self._batcher is not None:
            left = await self._batcher.close(grace_s)
            if left:
                self._gw.metrics.settlements.labels("dropped").inc(len(left))
                log.error(
                    "settlements_lost_on_shutdown",
                    count=len(left),
                    ledgers=[c.ledger for c in left[:20]],
                )
        if self._settlements is not None:
            await self._settlements.flush(grace_s)

    async def close_input_stops(self) -> None:
        """Stop the stops' refresh; write what is still unsent, once."""
        await self.stops.close()
