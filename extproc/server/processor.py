"""One request's processor: one method per ext_proc phase, each delegating to its module.

The servicer creates one :class:`RequestProcessor` per gRPC stream (one per HTTP request) and
calls :meth:`RequestProcessor.handle` per ProcessingRequest.  State changes go through the
request's :class:`Lifecycle`; the data of the request lives in its :class:`RequestContext`.

* request headers → :mod:`extproc.server.identity` (caller, path policy)
* request body → :mod:`extproc.server.admit` (count, plan, one admission call)
* response headers/body/trailers → :mod:`extproc.server.respond` decides how (from the status
  and headers), then :mod:`extproc.server.stream` meters SSE, or a JSON body's usage is read
* the end, whatever it is → :mod:`extproc.server.settle`, in the background, after the last
  response (with the request's final figures as dynamic metadata) has been sent

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
from extproc.core.lifecycle import (
    Closed,
    CutReason,
    Ending,
    Input,
    Lifecycle,
    LifecycleError,
    State,
)
from extproc.errors import (
    BadRequest,
    GatewayError,
    InternalError,
    UnmeterableResponse,
)
from extproc.errors import UnsupportedEncoding as UnsupportedRequestEncoding
from extproc.server import respond, wire
from extproc.server.admit import admit_body, admit_rpm_only
from extproc.server.context import RequestContext, metadata
from extproc.server.gateway import Gateway
from extproc.server.identity import IDENTITY_HEADERS, identify, route
from extproc.server.settle import settle
from extproc.server.stream import StreamDriver

log = structlog.get_logger("extproc")

# Non-streaming JSON bodies read for their usage are buffered up to this size.
MAX_USAGE_BODY = 8 << 20


class RequestProcessor:
    """The phases of one HTTP request."""

    __slots__ = ("_json", "ctx", "driver", "gw", "life", "write_lock", "writer")

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.ctx = RequestContext(cfg=gw.config)
        self.life = Lifecycle()
        self.driver: StreamDriver | None = None
        self._json: tuple[bytearray, Any] | None = None  # body read for usage, its decoder
        self.write_lock = asyncio.Lock()
        self.writer: Any = None  # the gRPC context, for a cut at shutdown

    @property
    def request_id(self) -> str:
        """Envoy's request id (or one we made up)."""
        return self.ctx.request_id

    # -- dispatch --------------------------------------------------------------------------

    async def handle(self, req: wire.ProcessingRequest) -> list[wire.ProcessingResponse]:
        """Answer one ProcessingRequest; client-facing errors become immediate responses."""
        which = req.WhichOneof("request")
        try:
            if which == "request_headers":
                return [await self.on_request_headers(req.request_headers, req)]
            if which == "request_body":
                return [await self.on_request_body(req.request_body)]
            if which == "response_headers":
                return [await self.on_response_headers(req.response_headers)]
            if which == "response_body":
                return await self.on_response_body(req.response_body)
            if which == "response_trailers":
                return self.on_response_trailers()
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
        ctx = self.ctx
        refused = err.status == 429
        decision = "refused" if refused else "error"
        self.gw.metrics.decisions.labels(decision, err.code).inc()
        log.info(
            "decision",
            request_id=ctx.request_id,
            tenant=ctx.tenant.id if ctx.tenant else None,
            model=ctx.model.name if ctx.model else None,
            decision=decision,
            status=err.status,
            code=err.code,
            message=err.message,
            latency_ms=ctx.latency_ms(),
        )
        self.life.refuse(Ending.REFUSED if refused else Ending.REJECTED)
        api = ctx.api or CHAT
        return wire.immediate(
            err.status,
            api.error_headers(err),
            api.error_body(err),
            f"ai_quota_{err.code}",
            metadata(ctx, self.life),
        )

    # -- request ---------------------------------------------------------------------------

    async def on_request_headers(self, hh: Any, req: Any = None) -> wire.ProcessingResponse:
        """Identify the caller; decide how the path is handled."""
        self.life.advance(Input.REQUEST_HEADERS)
        ctx = self.ctx
        h = wire.headers_of(hh)
        ctx.request_id = h.get("x-request-id", "") or f"gen-{id(self):x}-{time.time_ns()}"
        ctx.path = h.get(":path", "")
        found = api_for_path(ctx.path)
        ctx.api = self.gw.bind(found) if found else None  # errors speak the API's own shape
        structlog.contextvars.bind_contextvars(request_id=ctx.request_id)
        meta = wire.metadata_of(req) if ctx.cfg.identity.sources != ["api_key"] else None
        caller = identify(ctx.cfg, h, meta)
        ctx.key, ctx.tenant = caller.key, caller.tenant
        kind, api = route(ctx.cfg, ctx.path, h.get(":method", "POST"))
        if kind != "metered":
            if kind == "rpm_only":
                await admit_rpm_only(self.gw, ctx)
            self.life.advance(Input.PASS)
            return wire.continue_request_headers(
                caller.headers(), IDENTITY_HEADERS, mode=wire.passthrough_mode()
            )
        ctx.api = self.gw.bind(api) if api else None
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
            caller.headers(), (*IDENTITY_HEADERS, "accept-encoding")
        )

    async def on_request_body(self, body: Any) -> wire.ProcessingResponse:
        """Admit the request. In BUFFERED mode the body is whole even when trailers follow."""
        self.life.advance(Input.REQUEST_BODY)
        new_body = await admit_body(self.gw, self.ctx, body.body)
        self.life.advance(Input.ADMITTED)
        return wire.continue_request_body(new_body)

    # -- response --------------------------------------------------------------------------

    async def on_response_headers(self, hh: Any) -> wire.ProcessingResponse:
        """Add x-ratelimit-*; choose how the body is metered (:func:`respond.classify`)."""
        before = self.life.state
        self.life.advance(Input.RESPONSE_HEADERS)
        ctx = self.ctx
        h = wire.headers_of(hh)
        how = respond.classify(ctx, h, before, end_of_stream=hh.end_of_stream)
        if how.kind == "local_reply":  # Envoy's own reply (413 before the body reached us...)
            self.life.name_ending(Ending.LOCAL_REPLY)
            return wire.continue_response_headers()
        if how.kind == "unmetered":  # unmetered path, or admitted unmetered (fail-open)
            return wire.continue_response_headers(ctx.headers_out)
        if how.kind == "upstream_error":
            self.life.name_ending(Ending.UPSTREAM_ERROR)
            self.life.advance(Input.END)
            self._settle_later()
            return wire.continue_response_headers(
                ctx.headers_out, metadata=metadata(ctx, self.life, output_tokens=0)
            )
        if how.kind == "unmeterable":
            return self._unmeterable(how.reason)
        if how.kind == "stream":  # SSE, or SSE under a missing/odd content type
            self.driver = StreamDriver(self.gw, ctx, self.life, how.decoder)
            self.life.advance(Input.STREAM_START)
            self.gw.metrics.active_streams.inc()
            return wire.continue_response_headers(
                ctx.headers_out,
                remove=("content-length", "content-encoding"),
                mode=wire.full_duplex_mode(),
                metadata=metadata(ctx, self.life),
            )
        if how.kind == "read_json":
            self._json = (bytearray(), how.decoder)
            self.life.advance(Input.READ_BODY)
            return wire.continue_response_headers(
                ctx.headers_out, mode=wire.streamed_mode(), metadata=metadata(ctx, self.life)
            )
        self.life.advance(Input.END)
        self._settle_later()
        return wire.continue_response_headers(ctx.headers_out, metadata=metadata(ctx, self.life))

    def _unmeterable(self, what: str) -> wire.ProcessingResponse:
        """A 2xx response the meter cannot read: refused (fail-closed) or passed (fail-open)."""
        ctx = self.ctx
        if ctx.cfg.failure_mode_for(ctx.plan) == "open":
            log.warning("response_unmetered", request_id=ctx.request_id, reason=what)
            self.life.advance(Input.END)
            self._settle_later()
            return wire.continue_response_headers(ctx.headers_out)
        ctx.status = 502
        self.gw.metrics.stream_cuts.labels(CutReason.UNMETERABLE.value).inc()
        return self.reject(
            UnmeterableResponse(
                f"The upstream answered with {what}, which the gateway cannot meter; the "
                "response was not delivered. Ask the operator to fix the upstream."
            )
        )

    async def on_response_body(self, body: Any) -> list[wire.ProcessingResponse]:
        """Meter SSE (full duplex: we forward) or read a JSON body's usage (streamed)."""
        self.life.advance(Input.RESPONSE_BODY)
        if self.driver is not None:
            out = await self.driver.body(body.body, body.end_of_stream)
            if self.life.state in (State.DONE, State.CUT):
                self._settle_later()
            return out
        if self._json is not None and self.life.state is State.READING:
            buf, decoder = self._json
            if len(buf) < MAX_USAGE_BODY:
                buf += body.body
            if not body.end_of_stream:
                return [wire.continue_response_body()]
            return [wire.continue_response_body(self._finish_json(bytes(buf), decoder))]
        return [wire.continue_response_body()]

    def _finish_json(self, raw: bytes, decoder: Any) -> dict[str, object]:
        """The JSON body is complete: read its usage, end the request, settle in the background."""
        respond.read_json_usage(self.gw, self.ctx, raw, decoder)
        self.life.advance(Input.END)
        self._settle_later()
        return metadata(self.ctx, self.life, output_tokens=self.ctx.usage_output)

    def on_response_trailers(self) -> list[wire.ProcessingResponse]:
        """Trailers pass; a metered stream first flushes what it holds."""
        self.life.advance(Input.TRAILERS)
        out = self.driver.trailers() if self.driver is not None else []
        out.append(wire.continue_response_trailers())
        return out

    # -- the end ---------------------------------------------------------------------------

    def close(self, how: Closed) -> None:
        """The gRPC stream closed: name the ending and settle (once)."""
        self.life.close(how)
        self._settle_later()

    async def cut_for_shutdown(self) -> bool:
        """Cut a running stream with ``server_shutdown``; True when one was cut."""
        driver, writer = self.driver, self.writer
        if driver is None or writer is None or self.life.state is not State.STREAMING:
            return False
        async with self.write_lock:
            for resp in driver.cut(CutReason.SHUTDOWN):
                await writer.write(resp)
        self._settle_later()
        return True

    def _settle_later(self) -> None:
        """Settle in the background, once, after the current response is sent."""
        if not self.life.begin_settlement():
            return
        if self.driver is not None:
            self.gw.metrics.active_streams.dec()
        self.gw.track(asyncio.ensure_future(self._settle()))

    async def _settle(self) -> None:
        if self.life.ending is None:
            self.life.name_ending(Ending.COMPLETED)
        driver = self.driver
        output: int | None = None
        if driver is not None:
            if driver.charge_pending:
                try:
                    await asyncio.wait_for(asyncio.shield(driver.collect(wait=True)), 1.0)
                except Exception as exc:  # noqa: BLE001 - settlement must still run
                    log.warning("pending_charge_lost", request_id=self.request_id, error=repr(exc))
            output = driver.output_tokens()
            if driver.meter.usage is not None:
                self.ctx.usage_input = driver.meter.usage.prompt_tokens
                self.ctx.usage_cached_input = driver.meter.usage.cached_input_tokens
                self.ctx.usage_reasoning = driver.meter.usage.reasoning_tokens
        await settle(self.gw, self.ctx, self.life, output)
