"""The simulator's delivery engine: how one generation request's answer goes out on the wire,
streamed or not, on the planned schedule, with the injected faults (malformed data, error
events, resets, bursts, gzip, content length), recording what was actually written.

Disconnect detection: ``start_sim`` (and the CLI) run the app with aiohttp's
``handler_cancellation=True``, so when the peer goes away the handler task is cancelled at once and
the record gets ``client_disconnected`` within a loop iteration. When the app is served without
handler cancellation, the transport is checked before and after every sleep and write instead,
so the disconnect is noticed at the next token at the latest.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import socket
import struct
import time
from dataclasses import dataclass

import orjson
import structlog
from aiohttp import web

from extproc.sim.controls import SimControls
from extproc.sim.plan import Plan
from extproc.sim.records import SimRecord
from extproc.sim.request import GenerationRequest
from extproc.sim.script import (
    END_ABORT,
    END_ERROR_EVENT,
    Gzip,
    Script,
    Triggers,
    UsageFunc,
    build_stream,
    burst,
)
from extproc.sim.state import SimState
from extproc.sim.text import generate_pieces
from extproc.sim.wire import ENCODERS
from extproc.sim.wire.base import CONTENT, REASONING, TOOL, ChoiceOutput, Encoder, Unit, WireContext
from extproc.sim.wire.messages import tool_json_overhead, tool_json_units

log = structlog.get_logger(__name__)

#: the choice-index offset of the separately generated Anthropic tool-input text
_TOOL_TEXT_CHOICE = 1_000_000


class PeerGoneError(ConnectionResetError):
    """The client (or proxy) closed the connection."""


class SimResponse(web.StreamResponse):
    """A StreamResponse that can be sent without any Content-Type header (x-sim-content-type)."""

    drop_content_type = False

    async def _write_headers(self) -> None:
        if self.drop_content_type:
            self.headers.popall("Content-Type", None)
        await super()._write_headers()


@dataclass(slots=True)
class Delivery:
    """How the bytes go out: content type, gzip, content length, burst."""

    content_type: str | None
    gzip: bool
    content_length: bool
    burst: bool

    @classmethod
    def choose(
        cls, controls: SimControls, headers: dict[str, str], default_type: str, stream: bool
    ) -> Delivery:
        """The delivery the request's controls and Accept-Encoding ask for."""
        accept = headers.get("accept-encoding", "").lower()
        use_gzip = controls.gzip or (controls.honour_accept_encoding and "gzip" in accept)
        ctype: str | None = default_type
        if controls.content_type is not None:
            ctype = None if controls.content_type.lower() == "none" else controls.content_type
        return cls(
            content_type=ctype,
            gzip=use_gzip,
            content_length=controls.content_length and stream,
            burst=controls.burst_tokens is not None and stream,
        )

    def response(self, status: int, extra: dict[str, str]) -> SimResponse:
        """An unprepared response with this delivery's headers."""
        headers = dict(extra)
        if self.content_type is not None:
            headers["Content-Type"] = self.content_type
        if self.gzip:
            headers["Content-Encoding"] = "gzip"
        resp = SimResponse(status=status, headers=headers)
        resp.drop_content_type = self.content_type is None
        return resp

    def record(self, rec: SimRecord) -> None:
        """Note the delivery in the request's ground-truth record."""
        rec.content_type = self.content_type
        rec.content_encoding = "gzip" if self.gzip else None
        rec.burst = self.burst


class Generation:
    """One generation request being answered (streaming or not), for any generation API."""

    def __init__(
        self,
        request: web.Request,
        *,
        state: SimState,
        rec: SimRecord,
        api: str,
        req: GenerationRequest,
        controls: SimControls,
        plan: Plan,
        delivery: Delivery,
    ) -> None:
        cfg = state.config
        self.request = request
        self.state = state
        self.rec = rec
        self.api = api
        self.req = req
        self.controls = controls
        self.plan = plan
        self.delivery = delivery
        self.loop = asyncio.get_running_loop()
        self.ttft = (controls.ttft_ms if controls.ttft_ms is not None else cfg.ttft_ms) / 1000.0
        self.itl = (controls.itl_ms if controls.itl_ms is not None else cfg.itl_ms) / 1000.0
        self.per_chunk = controls.per_chunk or cfg.tokens_per_chunk
        # vLLM's stream_interval: the first token alone, then this many per chunk (the
        # server's own chunking is the floor)
        self.first_chunk: int | None = None
        if req.stream_interval is not None and req.stream_interval > 1:
            self.per_chunk = max(self.per_chunk, req.stream_interval)
            self.first_chunk = 1
        self.tool = controls.tool_call and api != "completions"
        self.choices = [self._units(i) for i in range(req.choices)]
        self.created = int(time.time())
        self.resp: web.StreamResponse | None = None
        rec.chunk_tokens = self.per_chunk
        rec.tokens_planned = sum(u.tokens for units in self.choices for u in units)

    def _units(self, index: int) -> list[Unit]:
        cfg = self.state.config
        seed = self.controls.seed if self.controls.seed is not None else cfg.seed
        count = self.plan.tokens_per_choice
        pieces = generate_pieces(cfg.text_mode, seed, index, count)
        reasoning = 0 if self.api == "completions" else min(self.controls.reasoning, count)
        units = [Unit(p, 1, REASONING) for p in pieces[:reasoning]]
        if self.tool and self.api == "messages":
            # Anthropic tool input must be JSON; its text starts fresh so it cannot merge
            inner = max(0, count - reasoning - tool_json_overhead())
            text = generate_pieces(cfg.text_mode, seed, _TOOL_TEXT_CHOICE + index, inner)
            return units + tool_json_units(text)
        kind = TOOL if self.tool else CONTENT
        return units + [Unit(p, 1, kind) for p in pieces[reasoning:]]

    def _encoder(self) -> Encoder:
        ctx = WireContext(
            sim_id=self.rec.sim_id,
            model=self.req.model,
            created=self.created,
            prompt_tokens=self.rec.prompt_tokens_reported,
            include_usage=self.req.include_usage,
            finish_reason=self.plan.finish_reason,
            choices=self.req.choices,
            tool=self.tool,
            max_output_tokens=self.req.requested_max_tokens,
        )
        return ENCODERS[self.api](ctx)

    # -- transport helpers -------------------------------------------------------------------

    def _check_peer(self) -> None:
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise PeerGoneError("peer closed the connection")

    async def _sleep_until(self, deadline: float) -> None:
        self._check_peer()
        delay = deadline - self.loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
            self._check_peer()

    async def _write(self, data: bytes) -> None:
        assert self.resp is not None
        self._check_peer()
        await self.resp.write(data)

    def _headers(self) -> dict[str, str]:
        return {"x-sim-id": self.rec.sim_id}

    # -- entry point ---------------------------------------------------------------------------

    async def run(self) -> web.StreamResponse:
        """Answer the request; the record gets how it ended (also when the peer goes away)."""
        store = self.state.store
        try:
            if self.req.stream:
                await self._stream()
            else:
                await self._unary()
        except asyncio.CancelledError:
            self._peer_gone()
            raise
        except ConnectionError:
            self._peer_gone()
        if self.resp is None:
            self.resp = web.Response(status=499)
        if not self.rec.finished:  # pragma: no cover - every path above sets an ending
            store.finish(self.rec, "completed", time.time())
        return self.resp

    def _peer_gone(self) -> None:
        now = time.time()
        if self.state.store.finish(self.rec, "client_disconnected", now):
            self.rec.disconnected_at = now
            log.info(
                "sim_client_disconnected",
                sim_id=self.rec.sim_id,
                request_id=self.rec.request_id,
                tokens_sent=self.rec.tokens_sent,
                tokens_planned=self.rec.tokens_planned,
            )

    async def _abort(self) -> None:
        """Flush what was written, then reset the TCP connection (no terminating chunk)."""
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise PeerGoneError("peer closed the connection")
        deadline = self.loop.time() + 1.0
        # asyncio has no "write buffer empty" event, so poll briefly before resetting
        while transport.get_write_buffer_size() > 0 and self.loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.001)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # linger 0 turns the close into a TCP RST; best effort, abort() closes regardless
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        now = time.time()
        if self.state.store.finish(self.rec, "injected_disconnect", now):
            log.info(
                "sim_injected_disconnect",
                sim_id=self.rec.sim_id,
                request_id=self.rec.request_id,
                tokens_sent=self.rec.tokens_sent,
            )
        transport.abort()

    def _complete(self, now: float) -> None:
        if self.state.store.finish(self.rec, "completed", now):
            log.debug(
                "sim_request_completed",
                sim_id=self.rec.sim_id,
                request_id=self.rec.request_id,
                tokens_sent=self.rec.tokens_sent,
            )

    # -- non-streaming -------------------------------------------------------------------------

    async def _unary(self) -> None:
        longest = max((sum(u.tokens for u in units) for units in self.choices), default=0)
        start = self.loop.time()
        await self._sleep_until(start + self.ttft + self.itl * max(0, longest - 1))
        total = sum(u.tokens for units in self.choices for u in units)
        outputs = [
            ChoiceOutput(
                index=i,
                reasoning="".join(u.text for u in units if u.kind == REASONING),
                answer="".join(u.text for u in units if u.kind != REASONING),
            )
            for i, units in enumerate(self.choices)
        ]
        reasoning = sum(u.tokens for units in self.choices for u in units if u.kind == REASONING)
        usage = UsageFunc(self.controls.usage)(total, reasoning)
        body = bytes(orjson.dumps(self._encoder().body(outputs, usage)))
        if self.delivery.gzip:
            body = gzip.compress(body, mtime=0)
        self._check_peer()
        self.rec.status = 200
        resp = self.delivery.response(200, self._headers())
        resp.content_length = len(body)
        self.resp = resp
        await resp.prepare(self.request)
        if self.controls.disconnect_after is not None:
            await resp.write(body[: len(body) // 2])
            await self._abort()
            return
        await resp.write(body)
        await resp.write_eof()
        now = time.time()
        self.state.store.add_tokens(self.rec, total, now)
        self.rec.usage_reported = usage.output
        self._complete(now)

    # -- streaming -----------------------------------------------------------------------------

    def _script(self, triggers: Triggers) -> Script:
        return build_stream(
            self._encoder(),
            self.choices,
            per_chunk=self.per_chunk,
            first_chunk=self.first_chunk,
            interval=self.itl * self.per_chunk,
            triggers=triggers,
            usage_for=UsageFunc(self.controls.usage),
        )

    async def _stream(self) -> None:
        controls = self.controls
        script = self._script(
            Triggers(
                malformed=controls.malformed_after,
                error_event=controls.error_event_after,
                disconnect=controls.disconnect_after,
            )
        )
        frames = burst(script.frames) if self.delivery.burst else script.frames
        zipper = Gzip() if self.delivery.gzip else None
        encoded = [zipper.chunk(f.data) if zipper else f.data for f in frames]
        tail = zipper.finish() if zipper is not None and script.end != END_ABORT else b""
        resp = self.delivery.response(200, {"Cache-Control": "no-cache", **self._headers()})
        if self.delivery.content_length:
            length = sum(map(len, encoded)) + len(tail)
            if script.end == END_ABORT:
                # the length of the stream as it would have been without the reset
                full = self._script(
                    Triggers(
                        malformed=controls.malformed_after, error_event=controls.error_event_after
                    )
                )
                full_zip = Gzip() if self.delivery.gzip else None
                parts = [full_zip.chunk(f.data) if full_zip else f.data for f in full.frames]
                length = sum(map(len, parts)) + (len(full_zip.finish()) if full_zip else 0)
            resp.content_length = length
            self.rec.content_length = length
        self.resp = resp
        self._check_peer()
        await resp.prepare(self.request)
        self.rec.status = 200
        store = self.state.store
        start = self.loop.time() + self.ttft
        await self._sleep_until(start)
        for frame, data in zip(frames, encoded, strict=True):
            if frame.at > 0:
                await self._sleep_until(start + frame.at)
            await self._write(data)
            if frame.tokens:
                store.add_tokens(self.rec, frame.tokens, time.time())
            if frame.usage_reported is not None:
                self.rec.usage_reported = frame.usage_reported
            if frame.note:
                log.info(
                    "sim_injected_" + frame.note.replace(",", "_"),
                    sim_id=self.rec.sim_id,
                    tokens_sent=self.rec.tokens_sent,
                )
        if script.end == END_ABORT:
            await self._abort()
            return
        if tail:
            await self._write(tail)
        await resp.write_eof()
        now = time.time()
        if script.end == END_ERROR_EVENT:
            if self.state.store.finish(self.rec, "error_status", now):
                self.rec.error = "injected_error_event"
            return
        self._complete(now)
