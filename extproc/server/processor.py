"""One request's processor: executes what its sans-IO :class:`Session` decides, phase by phase.

The servicer creates one :class:`RequestProcessor` per gRPC stream (one per HTTP request) and
calls :meth:`RequestProcessor.handle` per ProcessingRequest.  Every fact about the request is a
phase record of the session; most decisions are functions of the core (:mod:`extproc.core.session`,
:mod:`extproc.core.policies`, :mod:`extproc.core.classify`, :mod:`extproc.core.figures`), which
this module turns into Envoy messages, limiter calls, metrics and log lines.  It still moves
the request's lifecycle itself (a stream's moves are the core's :mod:`extproc.core.streaming`);
when a prompt admitted on a bound is counted and noted is the core's
:mod:`extproc.core.bound_count`, executed by :class:`extproc.server.counting.BoundCounting`.

* request headers → :mod:`extproc.server.identity` (the caller), the path's handling by the
  core's :mod:`extproc.core.routing`
* request body → :mod:`extproc.server.admit` (executes the core's :mod:`extproc.core.admission_flow`)
* response headers → :func:`extproc.core.classify.classify`; then :mod:`extproc.server.stream`
  executes the core's metered stream, or a JSON body's usage is read
* the end, whatever it is → :mod:`extproc.server.settle`, in the background, after the last
  response (with the request's final figures as dynamic metadata) has been sent: it executes
  the core's settlement plan (:mod:`extproc.core.settlement`)

Gateway errors raised in any phase become the API's own error response in :meth:`reject`, the
one place they are mapped.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

from extproc.core.apis.openai import CHAT
from extproc.core.apis.registry import api_for_path
from extproc.core.exact import ExactResponse
from extproc.core.keys import ledger_key
from extproc.core.lifecycle import (
    Closed,
    CutReason,
    LifecycleError,
)
from extproc.core.phase_records import Identified, Reported, Requested, StreamEnd
from extproc.core.policies import fails_open
from extproc.core.routing import public_path, route
from extproc.core.session import Session
from extproc.errors import (
    AuthenticationError,
    BadRequest,
    GatewayError,
    InternalError,
    UnmeterableResponse,
)
from extproc.errors import UnsupportedEncoding as UnsupportedRequestEncoding
from extproc.gateway import Gateway
from extproc.server import wire
from extproc.server.admit import admit_body, admit_rpm_only
from extproc.server.counting import BoundCounting
from extproc.server.identity import IDENTITY_HEADERS, end_user_hint, identify, presented_key
from extproc.server.settle import access_metadata, settle
from extproc.server.stream import StreamDriver
from extproc.server.writelock import WriteLock

log = structlog.get_logger("extproc")

# Non-streaming JSON bodies read for their usage are buffered up to this size.
MAX_USAGE_BODY = 8 << 20


class RequestProcessor:
    """The phases of one HTTP request."""

    __slots__ = (
        "_exact_response",
        "_first_chunk_ms",
        "_json",
        "_settle_pending",
        "cfg",
        "counting",
        "driver",
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
        self.s = Session()
        self.started = time.perf_counter()
        self.driver: StreamDriver | None = None
        self._json: tuple[bytearray, Any] | None = None  # body read for usage, its decoder
        self._exact_response: ExactResponse | None = None  # the exact path's kept stream
        self._first_chunk_ms = 0  # when a stream's first body chunk came (the decode rate)
        self.write_lock = WriteLock()
        self.writer: Any = None  # the gRPC context, for a cut at shutdown
        # the count of a prompt admitted on a bound, after admission
        self.counting = BoundCounting(gw, self.cfg, self.s)
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
            if which == "request_headers":
                return [await self.on_request_headers(req.request_headers, req)]
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
        s = self.s
        refused = err.status == 429
        self.trace.refused(err)
        decision = "refused" if refused else "error"
        self.gw.metrics.decisions.labels(decision, err.code).inc()
        log.info(
            "decision",
            request_id=s.request_id,
            tenant=s.tenant.id if s.tenant else None,
            model=s.model.name if s.model else None,
            decision=decision,
            status=err.status,
            code=err.code,
            message=err.message,
            latency_ms=self.latency_ms(),
        )
        s.answered(refused=refused)
        api = s.api or CHAT
        return wire.immediate(
            err.status,
            api.error_headers(err),
            api.error_body(err),
            f"ai_quota_{err.code}",
            access_metadata(s),
        )

    # -- request ---------------------------------------------------------------------------

    async def on_request_headers(self, hh: Any, req: Any = None) -> wire.ProcessingResponse:
        """Identify the caller; decide how the path is handled."""
        s, cfg, gw = self.s, self.cfg, self.gw
        s.request_headers()
        h = wire.headers_of(hh)
        up = self.trace.start(h)  # the traceparent to send upstream (none with tracing off)
        request_id = h.get("x-request-id", "") or f"gen-{id(self):x}-{time.time_ns()}"
        path = h.get(":path", "")
        found = api_for_path(path)
        # errors speak the API's own shape, even the caller's identification errors
        s.request(Requested(request_id, path, gw.bind(found) if found else None))
        structlog.contextvars.bind_contextvars(request_id=request_id)
        meta = (
            wire.metadata_of(req)
            if cfg.identity.sources != ["api_key"] or "jwt" in cfg.end_users.sources
            else None
        )
        method = h.get(":method", "POST")
        try:
            caller = identify(cfg, h, meta)
        except AuthenticationError:
            # a public path (a probe, a model listing) needs no identity; a key that is
            # presented must still be valid
            public = public_path(path, method, allowed=cfg.allowed_paths, public=cfg.public_paths)
            if presented_key(h) or not public:
                raise
            s.pass_through()
            return wire.continue_request_headers(up, IDENTITY_HEADERS, mode=wire.passthrough_mode())
        kind, api = route(path, method, allowed=cfg.allowed_paths, other=cfg.other_paths)
        metered_api = gw.bind(api) if api else None
        ledger = ledger_key(gw.key_prefix, caller.tenant.slot, gw.ledger_id(request_id))
        end_user, body_first = end_user_hint(cfg, h, meta)
        s.identify(
            Identified(
                request_id,
                path,
                metered_api if kind == "metered" else s.api,
                caller.key,
                caller.tenant,
                ledger,
                end_user=end_user,
                end_user_body=body_first,
            )
        )
        if kind != "metered":
            if kind == "rpm_only":
                await admit_rpm_only(gw, cfg, s)
            s.pass_through()
            return wire.continue_request_headers(
                [*caller.headers(), *up], IDENTITY_HEADERS, mode=wire.passthrough_mode()
            )
        encoding = h.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise UnsupportedRequestEncoding(
                f"The request body is sent with Content-Encoding '{encoding[:40]}'; the gateway "
                "reads uncompressed JSON only. Send the body without compression."
            )
        if hh.end_of_stream:
            raise BadRequest("the request has no body; expected a JSON object")
        # The upstream answers in identity encoding: the gateway must read what it meters.
        return wire.continue_request_headers(
            [*caller.headers(), *up], (*IDENTITY_HEADERS, "accept-encoding")
        )

    async def on_request_body(self, body: Any) -> wire.ProcessingResponse:
        """Admit the request. In BUFFERED mode the body is whole even when trailers follow."""
        self.s.request_body()
        new_body = await admit_body(self.gw, self.cfg, self.s, body.body, self.started)
        self.s.admission_done()
        self.trace.mark("admitted")
        self.counting.admitted(len(body.body))
        return wire.continue_request_body(new_body)

    # -- response --------------------------------------------------------------------------

    async def on_response_headers(self, hh: Any) -> wire.ProcessingResponse:
        """Add x-ratelimit-*; choose how the body is metered (:func:`classify`)."""
        s = self.s
        await self.counting.input_known()
        how = s.response_headers(
            wire.headers_of(hh),
            end_of_stream=hh.end_of_stream,
            fail_open=fails_open(self.cfg.failure_mode_for(s.plan)),
        )
        headers_out = list(s.headers_out)
        if how.kind == "local_reply":  # Envoy's own reply (413 before the body reached us...)
            return wire.continue_response_headers()
        if how.kind == "unmetered":  # unmetered path, or admitted unmetered (fail-open)
            return wire.continue_response_headers(headers_out)
        if how.kind == "upstream_error":
            await self.counting.figures_ready()  # the access log's input figure
            self._settle_later()
            return wire.continue_response_headers(
                headers_out, metadata=access_metadata(s, output_tokens=0)
            )
        if how.kind == "unmeterable":
            return self._unmeterable(how.reason)
        self.counting.response_metered()  # count now, when its figure may not stand uncounted
        if how.kind == "stream":  # SSE, or SSE under a missing/odd content type
            self.driver = StreamDriver(
                self.gw,
                self.cfg,
                s,
                how.decoder,
                figures_ready=self.counting.figures_ready,
                trace=self.trace,
            )
            self.gw.metrics.active_streams.inc()
            return wire.continue_response_headers(
                headers_out,
                remove=("content-length", "content-encoding"),
                mode=wire.full_duplex_mode(),
                metadata=access_metadata(s),
            )
        if how.kind == "exact":  # a non-stream sent upstream as a stream: JSON rebuilt
            self._exact_response = ExactResponse(s, how.decoder)
            headers_out.append(("content-type", "application/json"))
            return wire.continue_response_headers(
                headers_out,
                remove=("content-length", "content-encoding"),
                mode=wire.full_duplex_mode(),
                metadata=access_metadata(s),
            )
        if how.kind == "read_json":
            self._json = (bytearray(), how.decoder)
            return wire.continue_response_headers(
                headers_out, mode=wire.streamed_mode(), metadata=access_metadata(s)
            )
        self._settle_later()  # nothing to read: the response ended with its headers
        return wire.continue_response_headers(headers_out, metadata=access_metadata(s))

    def _unmeterable(self, what: str) -> wire.ProcessingResponse:
        """A 2xx response the meter cannot read: refused (fail-closed) or passed (fail-open)."""
        s = self.s
        if s.ended:  # the plan fails open: the session let it pass (and ended it)
            log.warning("response_unmetered", request_id=s.request_id, reason=what)
            self._settle_later()
            return wire.continue_response_headers(list(s.headers_out))
        self.gw.metrics.stream_cuts.labels(CutReason.UNMETERABLE.value).inc()
        return self.reject(
            UnmeterableResponse(
                f"The upstream answered with {what}, which the gateway cannot meter; the "
                "response was not delivered. Ask the operator to fix the upstream."
            )
        )

    async def on_response_body(self, body: Any) -> list[wire.ProcessingResponse]:
        """Meter SSE (full duplex: we forward) or read a JSON body's usage (streamed)."""
        s = self.s
        driver = self.driver
        if not self._first_chunk_ms:
            self._first_chunk_ms = self.gw.clock.now_ms()
            self.trace.mark("first_chunk")
        if driver is not None:  # the stream takes the chunk (and moves the lifecycle with it)
            out = await driver.body(body.body, body.end_of_stream)
            if driver.ended:
                self._settle_later()
            return out
        s.response_body()
        exact = self._exact_response
        if exact is not None:
            if not s.reading:
                return []
            body_out = exact.chunk(body.body, body.end_of_stream)
            if body_out is None:
                return []  # kept: nothing goes back while the upstream generates
            return [wire.streamed_body(body_out, True, await self._exact_done())]
        if self._json is not None and s.reading:
            buf, decoder = self._json
            if len(buf) < MAX_USAGE_BODY:
                buf += body.body
            if not body.end_of_stream:
                return [wire.continue_response_body()]
            return [wire.continue_response_body(await self._finish_json(bytes(buf), decoder))]
        return [wire.continue_response_body()]

    async def _finish_json(self, raw: bytes, decoder: Any) -> dict[str, object]:
        """The JSON body is complete: read its usage, end the request, settle in the background."""
        s = self.s
        assert s.api is not None
        try:
            plain = decoder.feed(raw) + decoder.flush() if decoder is not None else raw
        except Exception:  # a corrupt body has no usage to read
            plain = b""
        usage = s.api.json_usage(plain)
        if usage is not None:
            s.report(Reported.of(usage))
        if s.json_output() is not None:  # decided once: the access log and settlement read it
            await self.counting.figures_ready()  # the access log's input figure beside it
        s.response_read()
        self._settle_later()
        return access_metadata(s, output_tokens=s.output_decided)

    async def _exact_done(self) -> dict[str, object]:
        """The exact path's JSON is rebuilt (its usage reported): the figures, the end."""
        s = self.s
        if s.json_output() is not None:
            await self.counting.figures_ready()
        s.response_read()
        self._settle_later()
        return access_metadata(s, output_tokens=s.output_decided)

    async def on_response_trailers(self) -> list[wire.ProcessingResponse]:
        """Trailers pass; a metered stream first flushes what it holds (the exact path: its
        JSON goes before them)."""
        exact = self._exact_response
        if exact is not None and self.s.reading:
            body_out = exact.finish()
            self.s.response_trailers()
            return [
                wire.streamed_body(body_out, False, await self._exact_done()),
                wire.continue_response_trailers(),
            ]
        self.s.response_trailers()
        out = await self.driver.trailers() if self.driver is not None else []
        out.append(wire.continue_response_trailers())
        return out

    # -- the end ---------------------------------------------------------------------------

    def close(self, how: Closed) -> None:
        """The gRPC stream closed: name the ending and settle (once)."""
        complete = self.driver is not None and self.driver.complete
        self.s.close(how, stream_complete=complete)
        self._settle_later()
        self.sent()  # nothing more is written (a write that failed left one pending)

    async def cut_for_shutdown(self) -> bool:
        """Cut a running stream with ``server_shutdown``; True when one was cut."""
        driver, writer = self.driver, self.writer
        if driver is None or writer is None or not self.s.streaming:
            return False
        await self.counting.figures_ready()  # the cut's final figures
        async with self.write_lock:
            try:
                for resp in driver.cut(CutReason.SHUTDOWN):
                    await writer.write(resp)
            except Exception as exc:  # Envoy or the client closed the stream meanwhile
                # the cut is decided (settlement bills what was delivered); only the message
                # could not reach a client that is gone
                log.info("shutdown_cut_not_delivered", request_id=self.request_id, error=repr(exc))
        self._settle_later()
        self.sent()
        return True

    def _settle_later(self) -> None:
        """Settle in the background, once, after the current response is sent: with a
        :attr:`writer` (the servicer writes the responses) the task starts at :meth:`sent`, so
        that nothing it does runs on the event loop between the writes of those responses
        (a cut's error event and its immediate response: Envoy resets the upstream only on
        the second); without one (a caller that does not write) at once."""
        if not self.s.begin_settlement():
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
            self.gw.track(asyncio.ensure_future(self._settle()))

    async def _settle(self) -> None:
        self.trace.mark("response_end")
        try:
            await self._settle_figures()
        finally:
            self.trace.finish(self.s)  # the request's span and metrics, from its records
            self.counting.settled()

    async def _settle_figures(self) -> None:
        s = self.s
        self.counting.settling()
        await self.counting.figures_ready()
        s.settle_ending()
        driver = self.driver
        if driver is not None:
            # a charge not answered in time is counted once whether it ran (the settlement
            # takes it back) or not (a charge after the settlement charges nothing)
            await driver.settle_charge()
        if driver is not None:
            end: StreamEnd | None = driver.end()
        elif self._exact_response is not None:
            end = self._exact_response.end()  # None once its JSON was rebuilt: read as JSON
        else:
            end = None
        read_by_chunk = driver is not None or self._exact_response is not None
        await settle(self.gw, self.cfg, s, end, self._first_chunk_ms if read_by_chunk else 0)
