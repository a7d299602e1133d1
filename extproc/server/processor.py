"""One request's processor: a loop that feeds its sans-IO :class:`Session` the request's events
and executes the actions it returns (:mod:`extproc.core.envelope`).

The servicer creates one :class:`RequestProcessor` per gRPC stream (one per HTTP request) and
calls :meth:`RequestProcessor.handle` per ProcessingRequest.  The session's sub-machines
(admission, the metered stream: built by :mod:`~extproc.server.builders`, fed through the
session) have their actions executed by their modules: :mod:`~extproc.server.request_headers`, :mod:`~extproc.server.admit`,
:mod:`~extproc.server.stream`, :mod:`~extproc.server.body`, :mod:`~extproc.server.counting`,
:mod:`~extproc.server.ending` (settlement in the background, after the last response is sent).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

from extproc.core import envelope as ev
from extproc.core.lifecycle import Closed, LifecycleError
from extproc.core.policies import fails_open
from extproc.core.session import Session
from extproc.errors import GatewayError, InternalError
from extproc.gateway import Gateway
from extproc.server import wire
from extproc.server.admit import admit_body
from extproc.server.answer import error_response
from extproc.server.body import ResponseBody
from extproc.server.builders import RequestMachines
from extproc.server.context import RequestContext
from extproc.server.counting import BoundCounting
from extproc.server.ending import cut_stream, settle_request
from extproc.server.request_headers import on_request_headers as request_headers
from extproc.server.settle import figures_metadata
from extproc.server.stream import StreamDriver
from extproc.server.writelock import WriteLock

log = structlog.get_logger("extproc")

_MODES = {
    ev.BodyMode.UNCHANGED: None,
    ev.BodyMode.FULL_DUPLEX: wire.full_duplex_mode(),
    ev.BodyMode.STREAMED: wire.streamed_mode(),
}


class RequestProcessor:
    """The phases of one HTTP request."""

    __slots__ = (
        "_settle_pending",
        "body",
        "cfg",
        "counting",
        "ctx",
        "driver",
        "first_chunk_ms",
        "gw",
        "s",
        "started",
        "trace",
        "write_lock",
        "writer",
    )

    def __init__(self, gw: Gateway, call: Any = None) -> None:
        self.gw = gw
        self.trace = gw.telemetry.open(call)  # the request's span (a no-op with tracing off)
        self.cfg = gw.config  # the rules this request started with (a reload does not move it)
        self.s = Session(RequestMachines(gw, self.cfg))  # its sub-machines built on our rules
        self.ctx = RequestContext(gw, self.cfg, self.s)  # what the executors below read
        self.started = time.perf_counter()
        self.driver: StreamDriver | None = None
        self.body: ResponseBody | None = None  # a JSON body read for usage, or rebuilt
        self.first_chunk_ms = 0  # when a stream's first body chunk came (the decode rate)
        self.write_lock = WriteLock()
        self.writer: Any = None  # the gRPC context, for a cut at shutdown
        # the count of a prompt admitted on a bound, after admission
        self.counting = BoundCounting(self.ctx)
        self._settle_pending = False  # settlement decided, waiting for its response to be sent

    @property
    def request_id(self) -> str:
        """Envoy's request id (or one we made up)."""
        return self.s.request_id

    @property
    def open_lease(self) -> tuple[str, list[str]] | None:
        """(ledger, concurrency sets) while the reservation is open (renewed by the gateway)."""
        s = self.s
        if s.metered and s.ledger and not s.settling:
            return s.ledger, s.slots
        return None

    def latency_ms(self) -> float:
        """Milliseconds since the request headers arrived."""
        return round((time.perf_counter() - self.started) * 1000, 3)

    # -- dispatch --------------------------------------------------------------------------

    async def handle(self, req: wire.ProcessingRequest) -> list[wire.ProcessingResponse]:
        """Answer one ProcessingRequest; client-facing errors become immediate responses."""
        which = req.WhichOneof("request")
        try:
            if which == "response_body":  # most messages: one per streamed chunk
                return await self.on_response_body(req.response_body)
            if which == "request_headers":  # the caller, how the path is handled
                return [await request_headers(self.ctx, self.trace, req, own_id=f"{id(self):x}")]
            if which == "request_body":
                return [await self.on_request_body(req.request_body)]
            if which == "response_headers":
                return [await self.on_response_headers(req.response_headers)]
            if which == "response_trailers":
                return await self.on_response_trailers()
            if which == "request_trailers":
                return [wire.continue_request_trailers()]
            return []
        except GatewayError as err:
            return [self.reject(err)]
        except LifecycleError as exc:
            log.error("protocol_violation", request_id=self.request_id, error=str(exc))
            return [self.reject(InternalError("the gateway received messages out of order"))]

    def reject(self, err: GatewayError) -> wire.ProcessingResponse:
        """The single mapping from a gateway error to the client's HTTP response."""
        return error_response(self.gw, self.s, self.trace, err, self.latency_ms())

    # -- request ---------------------------------------------------------------------------

    async def on_request_body(self, body: Any) -> wire.ProcessingResponse:
        """Admit the request. In BUFFERED mode the body is whole even when trailers follow."""
        new_body = await admit_body(self.ctx, body.body, self.started, stream=self)
        self.s.handle(ev.AdmissionDone())
        self.trace.mark("admitted")
        self.counting.admitted(len(body.body))
        return wire.continue_request_body(new_body)

    # -- response: the session's envelope actions, executed -----------------------------------

    async def on_response_headers(self, hh: Any) -> wire.ProcessingResponse:
        """Add x-ratelimit-*; choose how the body is metered (the core's envelope)."""
        await self.counting.input_known()
        fail_open = fails_open(self.cfg.failure_mode_for(self.s.plan))
        event = ev.ResponseHeaders(wire.headers_of(hh), hh.end_of_stream, fail_open)
        out: list[wire.ProcessingResponse] = []
        for action in self.s.handle(event):
            await self._execute(action, out)
        return out[0]

    async def _execute(self, action: ev.EnvelopeAction, out: list[wire.ProcessingResponse]) -> None:
        """One of the envelope's actions; a response it makes goes to ``out``."""
        s, gw = self.s, self.gw
        match action:
            case ev.ForwardHeaders(headers, remove, mode, figures):
                meta = figures_metadata(s, figures)
                out.append(
                    wire.continue_response_headers(
                        headers, remove=remove, mode=_MODES[mode], metadata=meta
                    )
                )
            case ev.FiguresReady():
                await self.counting.figures_ready()
            case ev.CountInput():
                self.counting.response_metered()  # when its figure may not stand uncounted
            case ev.MeterStream():
                ready = self.counting.figures_ready
                self.driver = StreamDriver(self.ctx, figures_ready=ready, trace=self.trace)
                gw.metrics.active_streams.inc()
            case ev.RebuildJson(decoder) | ev.ReadJson(decoder):
                exact = isinstance(action, ev.RebuildJson)
                self.body = ResponseBody(s, self._events, decoder, exact=exact)
            case ev.Unmetered(reason):
                log.warning("response_unmetered", request_id=s.request_id, reason=reason)
            case ev.Reject(error, cut):
                if cut is not None:
                    gw.metrics.stream_cuts.labels(cut.value).inc()
                out.append(self.reject(error))
            case ev.Settle():
                self._settle_later()

    async def _events(self, *events: ev.EnvelopeEvent) -> None:
        """Feed events in order, executing what each asks (none answers Envoy here)."""
        for event in events:
            for action in self.s.handle(event):
                await self._execute(action, [])

    async def on_response_body(self, body: Any) -> list[wire.ProcessingResponse]:
        """Meter SSE (full duplex: we forward) or read a JSON body's usage (streamed)."""
        s, driver = self.s, self.driver
        if not self.first_chunk_ms:
            self.first_chunk_ms = self.gw.clock.now_ms()
            self.trace.mark("first_chunk")
        if driver is not None:  # the stream takes the chunk (and moves the lifecycle with it)
            out = await driver.body(body.body, body.end_of_stream)
            if driver.ended:
                self._settle_later()
            return out
        s.handle(ev.ResponseChunk())
        if self.body is not None:
            return await self.body.chunk(body.body, body.end_of_stream)
        return [wire.continue_response_body()]

    async def on_response_trailers(self) -> list[wire.ProcessingResponse]:
        """Trailers pass; a metered stream first flushes what it holds (the exact path: its
        JSON goes before them)."""
        if self.body is not None and (rebuilt := await self.body.trailers()) is not None:
            return rebuilt
        self.s.handle(ev.ResponseTrailers())
        out = await self.driver.trailers() if self.driver is not None else []
        out.append(wire.continue_response_trailers())
        return out

    # -- the end ---------------------------------------------------------------------------

    def close(self, how: Closed) -> None:
        """The gRPC stream closed: name the ending and settle (once)."""
        complete = self.driver is not None and self.driver.complete
        for _ in self.s.handle(ev.StreamClosed(how, complete)):  # settle, once
            self._settle_later()
        self.sent()  # nothing more is written (a write that failed left one pending)

    async def cut_for_shutdown(self) -> bool:
        """Cut a running stream with ``server_shutdown``; True when one was cut."""
        driver, writer = self.driver, self.writer
        if driver is None or writer is None or not self.s.streaming:
            return False
        await cut_stream(driver, writer, self.write_lock, self.counting, self.request_id)
        self._settle_later()
        self.sent()
        return True

    def _settle_later(self) -> None:
        """Settle in the background, once, after the current response is sent: at :meth:`sent`
        with a :attr:`writer` (nothing runs between the writes of those responses: a cut's
        error event and its immediate response), else at once."""
        if not self.s.handle(ev.ResponseOver()):  # StartSettlement, the first time only
            return
        if self.driver is not None:
            self.gw.metrics.active_streams.dec()
        self._settle_pending = True
        if self.writer is None:
            self.sent()

    def sent(self) -> None:
        """The responses of the last message are written (or never will be): start the
        settlement decided meanwhile, if any."""
        if self._settle_pending:
            self._settle_pending = False
            self.gw.background.track(asyncio.ensure_future(settle_request(self)))
