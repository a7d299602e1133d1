"""What every request of one process shares: the rules (swappable on reload), the limiter, the
clock, metrics, the usage recorder, the registry of open requests and the background tasks to
drain.

A neutral module: the ext_proc server, the usage API and the admin API all read it; it knows no
request processor, only the narrow :class:`OpenRequest` protocol (ledger, slots, settling, cut)
through which lease renewal and the shutdown cut see the requests in flight."""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from extproc.background import InputNotes, InputStops
from extproc.clock import Clock
from extproc.config.runtime import RuntimeConfig
from extproc.core.apis.base import ApiFormat
from extproc.core.audits import InputAudits
from extproc.core.decode_rate import DecodeRates
from extproc.core.room_hints import RoomHints
from extproc.errors import LimiterUnavailable
from extproc.limiter.base import (
    MAX_RIDERS,
    AdmitResult,
    InputNote,
    Limiter,
    SettleCall,
)
from extproc.limiter.batch import SETTLEMENT_RIDE_S, BatchSettings, Outcome, SettlementBatcher
from extproc.limiter.kept import SettlementQueue
from extproc.metrics import Metrics
from extproc.telemetry.base import NOOP as NO_TELEMETRY
from extproc.telemetry.base import Telemetry

if TYPE_CHECKING:
    from extproc.records.writer import UsageRecorder


class OpenRequest(Protocol):
    """A request in flight, as the shared registry sees it."""

    @property
    def open_lease(self) -> tuple[str, list[str]] | None:
        """(ledger, concurrency sets holding it) while its reservation is open, else None."""
        ...

    async def cut_for_shutdown(self) -> bool:
        """Cut a running stream with ``server_shutdown``; True when one was cut."""
        ...


log = structlog.get_logger("extproc")


@dataclass
class Gateway:
    """Shared state of one processor process."""

    config: RuntimeConfig
    limiter: Limiter
    clock: Clock
    metrics: Metrics
    key_prefix: str = "aiq"
    draining: bool = False
    # the drain's grace ends then (clock ms; 0: not draining), and its start, for the requests
    # waiting for their turn (those whose turn comes later do not wait: docs/operations.md)
    drain_deadline_ms: int = 0
    drain_started: asyncio.Event = field(default_factory=asyncio.Event)
    pending: set[asyncio.Task[Any]] = field(default_factory=set)
    active: set[OpenRequest] = field(default_factory=set)
    waiting: int = 0  # requests held waiting for their turn (docs/semantics.md, "Waiting")
    instance: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # Large prompts are counted in worker threads, this many at a time.
    count_slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(2))
    _serial: itertools.count[int] = field(default_factory=itertools.count)
    # The per-token counters' values admissions last answered (whether a bound may be used)
    room: RoomHints = field(default_factory=RoomHints)
    # the audit sampler, and the models whose upstream input figures a count contradicted
    input_audits: InputAudits = field(default_factory=InputAudits)
    # each model's decode rate, learned from its completed responses (abandons it cannot meter)
    decode_rates: DecodeRates = field(default_factory=DecodeRates)
    _settlements: SettlementQueue | None = None
    # Settlements go to Redis many per call, from one background task (when the limiter can)
    _batcher: SettlementBatcher | None = None
    # How the settlement batcher batches: a settlement waits a tick (2 ms) for others to share
    # its call, or, while admissions are flowing, up to ``ride_s`` for one to ride on
    batch_settings: BatchSettings = field(
        default_factory=lambda: BatchSettings(ride_s=SETTLEMENT_RIDE_S)
    )
    # Open reservations are leased (``failure.reservation_lease_seconds``) and renewed every
    # third of it while their request runs; a processor that dies stops renewing, and the
    # tenant's next admission refunds what it had reserved (the bound on what a SIGKILL leaks).
    _leases: asyncio.Task[None] | None = None
    _bound: dict[str, ApiFormat] = field(default_factory=dict)
    # One usage record per settled request goes here (a Redis Stream; None: off).
    recorder: UsageRecorder | None = None
    # Hash of the effective rules in force (file and admin store): metrics, the usage API.
    config_version: str = ""
    # OpenTelemetry traces and metrics (extproc/telemetry/); a no-op unless OTEL_* configure it
    telemetry: Telemetry = NO_TELEMETRY
    # Background jobs beside the requests (extproc.background): the input shortcut's stops
    # shared with the other replicas, and the exact input notes on their way to the ledgers
    stops: InputStops = field(init=False)
    notes: InputNotes = field(init=False)

    def __post_init__(self) -> None:
        self.stops = InputStops(self)
        self.notes = InputNotes(self)

    def install(self, config: RuntimeConfig, version: str) -> None:
        """Swap the rules in (requests in flight keep the ones they started with) and publish
        their version: ``aiq_config_version_info{version}`` = 1 for it alone (in Prometheus
        multi-process mode the previous version stays exported with 0)."""
        if version != self.config_version:
            # a new config version: the shortcut is earned again, and the stops found under
            # the old version no longer hold (docs/semantics.md)
            self.input_audits.reset()
        self.config, self.config_version = config, version
        gauge = self.metrics.config_version
        for (old,) in list(gauge._metrics):
            gauge.labels(old).set(0)
        gauge.clear()
        gauge.labels(version or "unknown").set(1)
        self.metrics.config_reload_time.set(time.time())

    def start_draining(self, grace_s: float) -> None:
        """The drain starts (after its notice): open streams have ``grace_s`` to end.  Requests
        waiting for a turn after that are told now (:meth:`drains_before`)."""
        self.drain_deadline_ms = self.clock.now_ms() + int(grace_s * 1000)
        self.draining = True
        self.drain_started.set()

    def drains_before(self, until_ms: int) -> bool:
        """Whether this replica drains and its grace ends before ``until_ms`` (a request
        waiting until then would be cut by the drain rather than served)."""
        return self.draining and until_ms > self.drain_deadline_ms

    def bind(self, api: ApiFormat) -> ApiFormat:
        """``api`` reading this gateway's clock where it renders times (Anthropic's
        ``*-reset`` headers are timestamps), made once per API."""
        bound = self._bound.get(api.name)
        if bound is None:
            with_clock = getattr(api, "with_clock", None)
            bound = with_clock(self.clock) if with_clock is not None else api
            self._bound[api.name] = bound
        return bound

    def audit_input(self, config: RuntimeConfig, model: str) -> bool:
        """Whether this request of ``model``, admitted on a bound, is counted exactly at once:
        to check the upstream's input figure (one in ``requests.input_audit_every``), or
        because that model's figures disagreed with a count before (:class:`InputAudits`)."""
        self.stops.bound_seen()  # the shortcut is in use: keep the shared stops fresh
        return self.input_audits.count_now(model, config.input_audit_every)

    def stop_input_shortcut(self, model: str, found: dict[str, Any]) -> None:
        """A count here contradicted ``model``'s upstream input figure: tell every replica
        (:meth:`extproc.background.InputStops.stop`)."""
        self.stops.stop(model, found)

    async def refresh_input_stops(self) -> list[str]:
        """Read the stops the other replicas found (:meth:`InputStops.refresh`)."""
        return await self.stops.refresh()

    async def close_input_stops(self) -> None:
        """Stop the stops' refresh; write what is still unsent, once."""
        await self.stops.close()

    def note_input(self, note: InputNote) -> None:
        """Write a request's exact input into its open ledger, in the background
        (:meth:`extproc.background.InputNotes.note`)."""
        self.notes.note(note)

    def ledger_id(self, request_id: str) -> str:
        """A ledger id unique to one HTTP request: Envoy's request id, this process, a serial.

        A client that sends its own ``x-request-id`` twice makes two requests, charged twice;
        only this process's own retries of one call can meet the same ledger.
        """
        return f"{request_id}.{self.instance}.{next(self._serial)}"

    @property
    def settlements(self) -> SettlementQueue:
        """Settlements that failed, kept until Redis answers again."""
        if self._settlements is None:
            self._settlements = SettlementQueue(self.limiter, self.metrics)
        return self._settlements

    @property
    def settle_batcher(self) -> SettlementBatcher | None:
        """The settlement batcher, when the limiter settles many per call (started lazily,
        in a context of its own)."""
        if self._batcher is None:
            if not hasattr(self.limiter, "settle_many"):
                return None
            self._batcher = SettlementBatcher(
                self.limiter,  # type: ignore[arg-type]
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
        busy = len(self.active) > 1  # the settling request may still be one of them
        contextvars.Context().run(partial(batcher.submit, call, busy=busy))
        self.metrics.settlement_backlog.set(len(batcher))

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
        rides_with = getattr(self.limiter, "rides_with", None)
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
        self.metrics.settlement_backlog.set(len(batcher))

    def _settled(self, outcome: Outcome[SettleCall, bool]) -> None:
        if outcome.result:
            self.metrics.settlements.labels("applied").inc()
        else:  # our own retried call found it applied (it never applies twice)
            self.metrics.duplicate_hits.labels("settle").inc()
        if self._batcher is not None:
            self.metrics.settlement_backlog.set(len(self._batcher))

    def settlements_full(self) -> bool:
        """Whether the settlements waiting for Redis (batched, and kept after a failure)
        reached the batcher's ``max_backlog``: admissions are then pushed back, so that no
        settlement is ever dropped (the requests in flight still add theirs)."""
        waiting = len(self._batcher) if self._batcher is not None else 0
        kept = len(self._settlements) if self._settlements is not None else 0
        return waiting + kept >= self.batch_settings.max_backlog

    def track(self, task: asyncio.Task[Any]) -> None:
        """Keep a background task alive until it ends (settlements are drained on shutdown)."""
        self.pending.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background_task_failed", error=repr(task.exception()))

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
        for p in list(self.active):
            lease = p.open_lease
            if lease is not None:
                held[lease[0]] = lease[1]
        return held

    async def _renew_loop(self) -> None:
        while True:
            lease_ms = self.config.reservation_lease_ms
            await asyncio.sleep(lease_ms / 3000)
            held = self.open_leases()
            if not held:
                continue
            try:
                await self.limiter.renew(list(held), self.clock.now_ms() + lease_ms, held=held)
            except LimiterUnavailable:
                log.warning("lease_renewal_failed", open=len(held))

    async def cut_streams_for_shutdown(self) -> int:
        """End every stream still open with a well-formed ``server_shutdown`` error; how many."""
        n = 0
        for proc in list(self.active):
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
                self.metrics.settlements.labels("dropped").inc(len(left))
                log.error(
                    "settlements_lost_on_shutdown",
                    count=len(left),
                    ledgers=[c.ledger for c in left[:20]],
                )
        if self._settlements is not None:
            await self._settlements.flush(grace_s)
