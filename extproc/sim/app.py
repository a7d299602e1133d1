"""aiohttp application of the upstream simulator: OpenAI endpoints, fault injection, ground truth.

Disconnect detection: ``start_sim`` (and the CLI) run the app with aiohttp's
``handler_cancellation=True``, so when the peer goes away the handler task is cancelled at once and
the record gets ``client_disconnected`` within a loop iteration. When the app is served without
handler cancellation, the transport is checked before and after every sleep and write instead,
so the disconnect is noticed at the next token at the latest.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from aiohttp import web

from extproc.sim.config import SimConfig
from extproc.sim.records import RecordStore, SimRecord
from extproc.sim.request import (
    GenerationRequest,
    Plan,
    RequestError,
    SimControls,
    parse_controls,
    parse_generation,
    plan_answer,
)
from extproc.sim.text import generate_pieces, vocabulary

log = structlog.get_logger(__name__)

MALFORMED_EVENT = b"data: {not json\n\n"
DONE_EVENT = b"data: [DONE]\n\n"
TOOL_NAME = "sim_tool"

_ERROR_TYPES: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", None),
    404: ("invalid_request_error", "model_not_found"),
    408: ("timeout", None),
    409: ("conflict_error", None),
    422: ("invalid_request_error", None),
    429: ("requests", "rate_limit_exceeded"),
}


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
    err_type, default_code = _ERROR_TYPES.get(
        status, ("server_error", None) if status >= 500 else ("invalid_request_error", None)
    )
    payload = {
        "error": {
            "message": message,
            "type": err_type,
            "param": param,
            "code": code if code is not None else default_code,
        }
    }
    return bytes(orjson.dumps(payload))


def _sse(obj: Any) -> bytes:
    return b"data: " + bytes(orjson.dumps(obj)) + b"\n\n"


class PeerGoneError(ConnectionResetError):
    """The client (or proxy) closed the connection."""


@dataclass(slots=True)
class _Choice:
    index: int
    pieces: list[str]
    reasoning: int
    pos: int = 0
    tool_started: bool = False


@dataclass(slots=True)
class _Triggers:
    malformed: int | None
    error_event: int | None
    disconnect: int | None
    fired: set[str] = field(default_factory=set)

    def next_cap(self, sent: int) -> int | None:
        caps = [
            t - sent
            for name, t in (
                ("malformed", self.malformed),
                ("error_event", self.error_event),
                ("disconnect", self.disconnect),
            )
            if t is not None and name not in self.fired and t > sent
        ]
        return min(caps) if caps else None


class _Generation:
    """One generation request being answered (streaming or not)."""

    def __init__(
        self,
        request: web.Request,
        *,
        state: SimState,
        rec: SimRecord,
        req: GenerationRequest,
        controls: SimControls,
        plan: Plan,
        chat: bool,
    ) -> None:
        cfg = state.config
        self.request = request
        self.state = state
        self.rec = rec
        self.req = req
        self.controls = controls
        self.plan = plan
        self.chat = chat
        self.loop = asyncio.get_running_loop()
        self.ttft = (controls.ttft_ms if controls.ttft_ms is not None else cfg.ttft_ms) / 1000.0
        self.itl = (controls.itl_ms if controls.itl_ms is not None else cfg.itl_ms) / 1000.0
        self.per_chunk = controls.tokens_per_chunk or cfg.tokens_per_chunk
        seed = controls.seed if controls.seed is not None else cfg.seed
        reasoning = min(controls.reasoning, plan.tokens_per_choice) if chat else 0
        self.tool = controls.tool_call and chat
        self.choices = [
            _Choice(i, generate_pieces(cfg.text_mode, seed, i, plan.tokens_per_choice), reasoning)
            for i in range(req.n)
        ]
        self.created = int(time.time())
        self.response_id = ("chatcmpl-" if chat else "cmpl-") + rec.sim_id
        self.resp: web.StreamResponse | None = None

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

    def _usage(self, completion: int) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.req.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.req.prompt_tokens + completion,
        }
        if self.chat:
            usage["completion_tokens_details"] = {
                "reasoning_tokens": sum(min(c.reasoning, c.pos) for c in self.choices)
            }
        return usage

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

    # -- non-streaming -------------------------------------------------------------------------

    async def _unary(self) -> None:
        longest = self.plan.tokens_per_choice
        start = self.loop.time()
        await self._sleep_until(start + self.ttft + self.itl * max(0, longest - 1))
        for choice in self.choices:
            choice.pos = len(choice.pieces)
        total = sum(len(c.pieces) for c in self.choices)
        body = bytes(orjson.dumps(self._unary_body(total)))
        self._check_peer()
        self.rec.status = 200
        if self.controls.disconnect_after is not None:
            partial = web.StreamResponse(status=200, headers=self._headers())
            partial.content_type = "application/json"
            partial.content_length = len(body)
            self.resp = partial
            await partial.prepare(self.request)
            await partial.write(body[: len(body) // 2])
            await self._abort()
            return
        resp = web.Response(body=body, content_type="application/json", headers=self._headers())
        self.resp = resp
        await resp.prepare(self.request)
        await resp.write_eof()
        now = time.time()
        self.state.store.add_tokens(self.rec, total, now)
        self._complete(now)

    def _unary_body(self, total: int) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for c in self.choices:
            if self.chat:
                reasoning_text = "".join(c.pieces[: c.reasoning])
                answer = "".join(c.pieces[c.reasoning :])
                message: dict[str, Any] = {"role": "assistant", "content": None, "refusal": None}
                if self.tool:
                    message["tool_calls"] = [self._tool_call_full(c.index, answer)]
                else:
                    message["content"] = answer
                if c.reasoning:
                    message["reasoning_content"] = reasoning_text
                choices.append(
                    {
                        "index": c.index,
                        "message": message,
                        "logprobs": None,
                        "finish_reason": self.plan.finish_reason,
                    }
                )
            else:
                choices.append(
                    {
                        "index": c.index,
                        "text": "".join(c.pieces),
                        "logprobs": None,
                        "finish_reason": self.plan.finish_reason,
                    }
                )
        return {
            "id": self.response_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.req.model,
            "system_fingerprint": "ai-quota-sim",
            "choices": choices,
            "usage": self._usage(total),
        }

    def _tool_call_full(self, index: int, arguments: str) -> dict[str, Any]:
        return {
            "id": f"call_{self.rec.sim_id}_{index}",
            "type": "function",
            "function": {"name": TOOL_NAME, "arguments": arguments},
        }

    def _complete(self, now: float) -> None:
        if self.state.store.finish(self.rec, "completed", now):
            log.debug(
                "sim_request_completed",
                sim_id=self.rec.sim_id,
                request_id=self.rec.request_id,
                tokens_sent=self.rec.tokens_sent,
            )

    # -- streaming -----------------------------------------------------------------------------

    def _chunk(
        self, index: int, delta: dict[str, Any] | None, text: str | None, finish: str | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = delta if delta is not None else {}
        else:
            choice["text"] = text if text is not None else ""
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        obj: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.req.model,
            "system_fingerprint": "ai-quota-sim",
            "choices": [choice],
        }
        if self.req.include_usage:
            obj["usage"] = None
        return obj

    def _content_delta(self, c: _Choice, text: str, reasoning: bool) -> dict[str, Any]:
        if reasoning:
            return {"reasoning_content": text}
        if not self.tool:
            return {"content": text}
        if not c.tool_started:
            c.tool_started = True
            call: dict[str, Any] = {
                "index": 0,
                "id": f"call_{self.rec.sim_id}_{c.index}",
                "type": "function",
                "function": {"name": TOOL_NAME, "arguments": text},
            }
        else:
            call = {"index": 0, "function": {"arguments": text}}
        return {"tool_calls": [call]}

    async def _fire_triggers(self, triggers: _Triggers, end_of_content: bool) -> bool:
        """Emit due injections; returns True when the stream must stop here."""
        sent = self.rec.tokens_sent

        def due(name: str, at: int | None) -> bool:
            return at is not None and name not in triggers.fired and (sent >= at or end_of_content)

        if due("malformed", triggers.malformed):
            triggers.fired.add("malformed")
            await self._write(MALFORMED_EVENT)
            log.info("sim_injected_malformed", sim_id=self.rec.sim_id, tokens_sent=sent)
        if due("error_event", triggers.error_event):
            triggers.fired.add("error_event")
            event = {
                "error": {
                    "message": "injected in-stream error (x-sim-error-event-after)",
                    "type": "server_error",
                    "param": None,
                    "code": "sim_injected_error",
                }
            }
            await self._write(_sse(event))
            assert self.resp is not None
            await self.resp.write_eof()
            now = time.time()
            if self.state.store.finish(self.rec, "error_status", now):
                self.rec.error = "injected_error_event"
                log.info("sim_injected_error_event", sim_id=self.rec.sim_id, tokens_sent=sent)
            return True
        if due("disconnect", triggers.disconnect):
            triggers.fired.add("disconnect")
            await self._abort()
            return True
        return False

    async def _stream(self) -> None:
        resp = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **self._headers(),
            },
        )
        self.resp = resp
        self._check_peer()
        await resp.prepare(self.request)
        self.rec.status = 200
        triggers = _Triggers(
            malformed=self.controls.malformed_after,
            error_event=self.controls.error_event_after,
            disconnect=self.controls.disconnect_after,
        )
        start = self.loop.time() + self.ttft
        await self._sleep_until(start)
        if self.chat:
            for c in self.choices:
                await self._write(
                    _sse(self._chunk(c.index, {"role": "assistant", "content": ""}, None, None))
                )
        if await self._fire_triggers(triggers, end_of_content=False):
            return
        store = self.state.store
        interval = self.itl * self.per_chunk
        step = 0
        while any(c.pos < len(c.pieces) for c in self.choices):
            if step:
                await self._sleep_until(start + step * interval)
            step += 1
            for c in self.choices:
                remaining = len(c.pieces) - c.pos
                if remaining <= 0:
                    continue
                take = min(self.per_chunk, remaining)
                in_reasoning = c.pos < c.reasoning
                if in_reasoning:
                    take = min(take, c.reasoning - c.pos)
                cap = triggers.next_cap(self.rec.tokens_sent)
                if cap is not None:
                    take = min(take, cap)
                text = "".join(c.pieces[c.pos : c.pos + take])
                delta = self._content_delta(c, text, in_reasoning) if self.chat else None
                await self._write(_sse(self._chunk(c.index, delta, text, None)))
                c.pos += take
                store.add_tokens(self.rec, take, time.time())
                if await self._fire_triggers(triggers, end_of_content=False):
                    return
        if await self._fire_triggers(triggers, end_of_content=True):
            return
        for c in self.choices:
            await self._write(_sse(self._chunk(c.index, {}, "", self.plan.finish_reason)))
        if self.req.include_usage:
            usage_chunk: dict[str, Any] = {
                "id": self.response_id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created,
                "model": self.req.model,
                "system_fingerprint": "ai-quota-sim",
                "choices": [],
                "usage": self._usage(self.rec.tokens_sent),
            }
            await self._write(_sse(usage_chunk))
        await self._write(DONE_EVENT)
        await resp.write_eof()
        self._complete(time.time())


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
    return web.Response(
        body=error_body(err.status, err.message, err.param, err.code),
        status=err.status,
        content_type="application/json",
        headers={"x-sim-id": rec.sim_id},
    )


async def _handle_generation(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    cfg = state.config
    rec = state.store.new(request.path, time.time())
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
        req = parse_generation(body, chat=chat, config=cfg)
        rec.model = req.model
        rec.stream = req.stream
        rec.n = req.n
        rec.include_usage = req.include_usage
        rec.prompt_tokens = req.prompt_tokens
        controls = parse_controls(headers)
        if not chat:  # reasoning and tool calls only exist in the chat format
            controls = dataclasses.replace(controls, reasoning=0, tool_call=False)
        plan = plan_answer(req, controls, cfg)
        rec.max_tokens = plan.limit
        rec.tokens_planned = plan.tokens_per_choice * req.n
        if controls.slow_start_ms:
            await asyncio.sleep(controls.slow_start_ms / 1000.0)
        if controls.status is not None:
            raise RequestError(
                controls.status, f"injected error status {controls.status} (x-sim-status)"
            )
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
                tokens_sent=0,
            )
        raise
    gen = _Generation(
        request, state=state, rec=rec, req=req, controls=controls, plan=plan, chat=chat
    )
    return await gen.run()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    return await _handle_generation(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    return await _handle_generation(request, chat=False)


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models in the OpenAI list format."""
    cfg = request.app[STATE_KEY].config
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": "ai-quota-sim"} for m in cfg.models
    ]
    return _json({"object": "list", "data": data})


async def healthz(request: web.Request) -> web.Response:
    """GET /healthz."""
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
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/healthz", healthz)
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
