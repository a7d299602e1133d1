"""aiohttp application of the upstream simulator: generation APIs, fault injection, ground truth.

Disconnect detection: ``start_sim`` (and the CLI) run the app with aiohttp's
``handler_cancellation=True``, so when the peer goes away the handler task is cancelled at once and
the record gets ``client_disconnected`` within a loop iteration. When the app is served without
handler cancellation, the transport is checked before and after every sleep and write instead,
so the disconnect is noticed at the next token at the latest.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import gzip
import math
import random
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import structlog
from aiohttp import web

from extproc.sim.config import SimConfig
from extproc.sim.records import RecordStore, SimRecord
from extproc.sim.request import (
    EmbeddingsRequest,
    GenerationRequest,
    Plan,
    RequestError,
    SimControls,
    parse_controls,
    parse_embeddings,
    parse_generation,
    parse_messages,
    parse_responses,
    plan_answer,
)
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
from extproc.sim.text import generate_pieces, vocabulary
from extproc.sim.wire import (
    CONTENT,
    DONE_EVENT,
    ENCODERS,
    MALFORMED_DATA,
    REASONING,
    TOOL,
    TOOL_NAME,
    ChoiceOutput,
    Encoder,
    Unit,
    WireContext,
    anthropic_error,
    openai_error,
    tool_json_overhead,
    tool_json_units,
)

log = structlog.get_logger(__name__)

MALFORMED_EVENT = MALFORMED_DATA
__all__ = [
    "DONE_EVENT",
    "MALFORMED_EVENT",
    "STATE_KEY",
    "TOOL_NAME",
    "SimState",
    "error_body",
    "make_app",
    "start_sim",
]

#: the choice-index offset of the separately generated Anthropic tool-input text
_TOOL_TEXT_CHOICE = 1_000_000


@dataclass(slots=True)
class SimState:
    """Process-wide simulator state shared by all handlers."""

    config: SimConfig
    store: RecordStore


STATE_KEY = web.AppKey("ai_quota_sim_state", SimState)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> bytes:
    """OpenAI-style error JSON for ``status``."""
    return bytes(orjson.dumps(openai_error(status, message, param, code)))


class PeerGoneError(ConnectionResetError):
    """The client (or proxy) closed the connection."""


class _SimResponse(web.StreamResponse):
    """A StreamResponse that can be sent without any Content-Type header (x-sim-content-type)."""

    drop_content_type = False

    async def _write_headers(self) -> None:
        if self.drop_content_type:
            self.headers.popall("Content-Type", None)
        await super()._write_headers()


@dataclass(slots=True)
class _Delivery:
    """How the bytes go out: content type, gzip, content length, burst."""

    content_type: str | None
    gzip: bool
    content_length: bool
    burst: bool

    @classmethod
    def choose(
        cls, controls: SimControls, headers: dict[str, str], default_type: str, stream: bool
    ) -> _Delivery:
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

    def response(self, status: int, extra: dict[str, str]) -> _SimResponse:
        headers = dict(extra)
        if self.content_type is not None:
            headers["Content-Type"] = self.content_type
        if self.gzip:
            headers["Content-Encoding"] = "gzip"
        resp = _SimResponse(status=status, headers=headers)
        resp.drop_content_type = self.content_type is None
        return resp

    def record(self, rec: SimRecord) -> None:
        rec.content_type = self.content_type
        rec.content_encoding = "gzip" if self.gzip else None
        rec.burst = self.burst


class _Generation:
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
        delivery: _Delivery,
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
            prompt_tokens=self.req.prompt_tokens,
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


# -- handlers ----------------------------------------------------------------------------------


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=bytes(orjson.dumps(obj)), status=status, content_type="application/json"
    )


async def _error_response(
    request: web.Request, state: SimState, rec: SimRecord, err: RequestError
) -> web.Response:
    rec.status = err.status
    rec.error = err.message
    state.store.finish(rec, "error_status", time.time())
    log.info(
        "sim_error_status",
        sim_id=rec.sim_id,
        request_id=rec.request_id,
        status=err.status,
        message=err.message,
    )
    if rec.api == "messages":
        body = bytes(orjson.dumps(anthropic_error(err.status, err.message)))
    else:
        body = error_body(err.status, err.message, err.param, err.code)
    return web.Response(
        body=body,
        status=err.status,
        content_type="application/json",
        headers={"x-sim-id": rec.sim_id},
    )


def _parse_generation(api: str, body: Any, config: SimConfig) -> GenerationRequest:
    if api == "responses":
        return parse_responses(body, config=config)
    if api == "messages":
        return parse_messages(body, config=config)
    return parse_generation(body, chat=api == "chat", config=config)


async def _before_answer(controls: SimControls) -> None:
    """Injected slow start and error status (both apply before anything is generated)."""
    if controls.slow_start_ms:
        await asyncio.sleep(controls.slow_start_ms / 1000.0)
    if controls.status is not None:
        raise RequestError(
            controls.status, f"injected error status {controls.status} (x-sim-status)"
        )


_Answer = Callable[[SimRecord, dict[str, str], Any], Awaitable[web.StreamResponse]]


async def _handle(request: web.Request, api: str, answer: _Answer) -> web.StreamResponse:
    """Common frame of every API handler: record, parse, reject, answer."""
    state = request.app[STATE_KEY]
    rec = state.store.new(request.path, time.time())
    rec.api = api
    headers = {k.lower(): v for k, v in request.headers.items()}
    rec.request_id = headers.get("x-request-id")
    rec.client_request_id = headers.get("x-client-request-id")
    rec.tenant = headers.get("x-quota-tenant")
    rec.headers_seen = {k: v for k, v in headers.items() if k.startswith("x-")}
    try:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            raise RequestError(400, "We could not parse the JSON body of your request.") from None
        return await answer(rec, headers, body)
    except RequestError as err:
        return await _error_response(request, state, rec, err)
    except (asyncio.CancelledError, ConnectionError):
        now = time.time()
        if state.store.finish(rec, "client_disconnected", now):
            rec.disconnected_at = now
            log.info(
                "sim_client_disconnected",
                sim_id=rec.sim_id,
                request_id=rec.request_id,
                tokens_sent=rec.tokens_sent,
            )
        raise


async def _handle_generation(request: web.Request, api: str) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    cfg = state.config

    async def answer(rec: SimRecord, headers: dict[str, str], body: Any) -> web.StreamResponse:
        req = _parse_generation(api, body, cfg)
        rec.model = req.model
        rec.stream = req.stream
        rec.n = req.n
        rec.prompts = req.prompts
        rec.choices = req.choices
        rec.include_usage = req.include_usage
        rec.prompt_tokens = req.prompt_tokens
        rec.max_tokens_seen = req.requested_max_tokens
        controls = parse_controls(headers)
        if api == "completions":  # reasoning and tool calls do not exist in this format
            controls = dataclasses.replace(controls, reasoning=0, tool_call=False)
        if controls.usage is not None:
            rec.usage_lie = headers.get("x-sim-usage")
        plan = plan_answer(req, controls, cfg)
        rec.max_tokens = plan.limit
        rec.tokens_planned = plan.tokens_per_choice * req.choices
        await _before_answer(controls)
        default_type = "text/event-stream" if req.stream else "application/json"
        delivery = _Delivery.choose(controls, headers, default_type, req.stream)
        delivery.record(rec)
        gen = _Generation(
            request,
            state=state,
            rec=rec,
            api=api,
            req=req,
            controls=controls,
            plan=plan,
            delivery=delivery,
        )
        return await gen.run()

    return await _handle(request, api, answer)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    return await _handle_generation(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    return await _handle_generation(request, "completions")


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses (OpenAI Responses API)."""
    return await _handle_generation(request, "responses")


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages (Anthropic Messages API)."""
    return await _handle_generation(request, "messages")


def embedding_vector(model: str, key: str, dims: int) -> list[float]:
    """Deterministic unit-length vector for one input (same model, input, size: same vector)."""
    rng = random.Random(f"ai-quota-sim:embedding:{model}:{key}")
    values = [rng.gauss(0.0, 1.0) for _ in range(dims)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


def _embeddings_body(req: EmbeddingsRequest) -> dict[str, Any]:
    data: list[dict[str, Any]] = []
    for index, key in enumerate(req.input_keys):
        vector = embedding_vector(req.model, key, req.dimensions)
        encoded: Any = vector
        if req.encoding_format == "base64":
            raw = struct.pack(f"<{len(vector)}f", *vector)
            encoded = base64.b64encode(raw).decode("ascii")
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    return {
        "object": "list",
        "data": data,
        "model": req.model,
        "usage": {"prompt_tokens": req.prompt_tokens, "total_tokens": req.prompt_tokens},
    }


async def embeddings(request: web.Request) -> web.StreamResponse:
    """POST /v1/embeddings: small deterministic vectors; input tokens are recorded."""
    state = request.app[STATE_KEY]
    cfg = state.config

    async def answer(rec: SimRecord, headers: dict[str, str], body: Any) -> web.StreamResponse:
        req = parse_embeddings(body, config=cfg)
        rec.model = req.model
        rec.prompts = len(req.input_keys)
        rec.choices = len(req.input_keys)
        rec.prompt_tokens = req.prompt_tokens
        controls = parse_controls(headers)
        await _before_answer(controls)
        ttft = controls.ttft_ms if controls.ttft_ms is not None else cfg.ttft_ms
        await asyncio.sleep(ttft / 1000.0)
        delivery = _Delivery.choose(controls, headers, "application/json", stream=False)
        delivery.record(rec)
        payload = bytes(orjson.dumps(_embeddings_body(req)))
        if delivery.gzip:
            payload = gzip.compress(payload, mtime=0)
        resp = delivery.response(200, {"x-sim-id": rec.sim_id})
        resp.content_length = len(payload)
        rec.status = 200
        await resp.prepare(request)
        await resp.write(payload)
        await resp.write_eof()
        state.store.finish(rec, "completed", time.time())
        return resp

    return await _handle(request, "embeddings", answer)


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models in the OpenAI list format."""
    cfg = request.app[STATE_KEY].config
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": "ai-quota-sim"} for m in cfg.models
    ]
    return _json({"object": "list", "data": data})


async def healthz(request: web.Request) -> web.Response:
    """GET /healthz and GET /health."""
    return _json({"status": "ok"})


async def list_records(request: web.Request) -> web.Response:
    """GET /sim/requests[?client_request_id=...]."""
    store = request.app[STATE_KEY].store
    crid = request.query.get("client_request_id")
    return _json({"requests": [r.to_dict() for r in store.list(crid)]})


async def get_record(request: web.Request) -> web.Response:
    """GET /sim/requests/{sim_id}."""
    rec = request.app[STATE_KEY].store.get(request.match_info["sim_id"])
    if rec is None:
        return web.Response(
            body=error_body(404, "no such simulator record", code="not_found"),
            status=404,
            content_type="application/json",
        )
    return _json(rec.to_dict())


async def clear_records(request: web.Request) -> web.Response:
    """DELETE /sim/requests."""
    request.app[STATE_KEY].store.clear()
    return _json({"cleared": True})


async def stats(request: web.Request) -> web.Response:
    """GET /sim/stats."""
    return _json(request.app[STATE_KEY].store.stats())


def make_app(config: SimConfig) -> web.Application:
    """Build the simulator application (verifies the token vocabulary eagerly)."""
    vocabulary()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[STATE_KEY] = SimState(config=config, store=RecordStore(config.max_records))
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/health", healthz)
    app.router.add_get("/sim/requests", list_records)
    app.router.add_delete("/sim/requests", clear_records)
    app.router.add_get("/sim/requests/{sim_id}", get_record)
    app.router.add_get("/sim/stats", stats)
    return app


async def start_sim(config: SimConfig) -> tuple[web.AppRunner, int]:
    """Serve the simulator on ``config.host:config.port`` (0 = any free port).

    Returns the runner (call ``await runner.cleanup()`` to stop) and the bound port.
    """
    app = make_app(config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_address=True)
    await site.start()
    port = int(runner.addresses[0][1])
    log.info("sim_listening", host=config.host, port=port, models=list(config.models))
    return runner, port
