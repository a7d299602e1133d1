"""What serving one request of a process needs, shared by all of them: the rules (swappable on
reload), the limiter, the clock, metrics, the usage recorder, telemetry, the registry of open
requests, the learned hints (room, audits, decode rates), and the process's
:class:`~extproc.background.Background` part (settlements, leases, the input shortcut's stops
and notes) that requests hand work to.

A neutral module: the ext_proc server, the usage API and the admin API all read it; it knows no
request processor, only the narrow :class:`OpenRequest` protocol (ledger, slots, settling, cut)
through which lease renewal and the shutdown cut see the requests in flight."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING

from extproc.background import Background, OpenRequest
from extproc.clock import Clock
from extproc.config.runtime import RuntimeConfig
from extproc.core.apis.base import ApiFormat
from extproc.core.audits import InputAudits
from extproc.core.decode_rate import DecodeRates
from extproc.core.room_hints import RoomHints
from extproc.limiter.base import Limiter
from extproc.limiter.batch import BatchSettings
from extproc.metrics import Metrics
from extproc.telemetry.base import NOOP as NO_TELEMETRY
from extproc.telemetry.base import Telemetry

if TYPE_CHECKING:
    from extproc.records.writer import UsageRecorder

__all__ = ["Gateway", "OpenRequest"]


@dataclass
class Gateway:
    """What the requests of one processor process share."""

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
    _bound: dict[str, ApiFormat] = field(default_factory=dict)
    # One usage record per settled request goes here (a Redis Stream; None: off).
    recorder: UsageRecorder | None = None
    # Hash of the effective rules in force (file and admin store): metrics, the usage API.
    config_version: str = ""
    # OpenTelemetry traces and metrics (extproc/telemetry/); a no-op unless OTEL_* configure it
    telemetry: Telemetry = NO_TELEMETRY
    # How the background's settlement batcher batches (None: the defaults)
    batch_settings: InitVar[BatchSettings | None] = None
    # What runs beside the requests (extproc.background): settlements, leases, input stops
    # and notes, the tasks to drain at shutdown
    background: Background = field(init=False)

    def __post_init__(self, batch_settings: BatchSettings | None) -> None:
        self.background = Background(self, batch_settings)

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
        self.background.stops.bound_seen()  # the shortcut is in use: keep the stops fresh
        return self.input_audits.count_now(model, config.input_audit_every)

    def ledger_id(self, request_id: str) -> str:
        """A ledger id unique to one HTTP request: Envoy's request id, this process, a serial.

        A client that sends its own ``x-request-id`` twice makes two requests, charged twice;
        only this process's own retries of one call can meet the same ledger.
        """
        return f"{request_id}.{self.instance}.{next(self._serial)}"
