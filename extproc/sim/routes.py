"""The simulator's HTTP routes: the generation and embeddings APIs (each records the request,
parses it, applies the injected slow start or error status, then hands the answer to
:mod:`extproc.sim.delivery`), the model list, health, and the ground-truth record endpoints."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import gzip
import math
import random
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import structlog
from aiohttp import web

from extproc.sim.config import SimConfig
from extproc.sim.controls import SimControls, parse_controls
from extproc.sim.delivery import Delivery, Generation
from extproc.sim.plan import plan_answer
from extproc.sim.records import SimRecord
from extproc.sim.request import (
    EmbeddingsRequest,
    GenerationRequest,
    RequestError,
    parse_embeddings,
    parse_generation,
    parse_messages,
    parse_responses,
)
from extproc.sim.state import STATE_KEY, SimState
from extproc.sim.wire.errors import anthropic_error, openai_error

log = structlog.get_logger(__name__)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> bytes:
    """OpenAI-style error JSON for ``status``."""
    return bytes(orjson.dumps(openai_error(status, message, param, code)))


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
    # the x- headers, and the trace context the engine would nest its spans under
    rec.headers_seen = {
        k: v for k, v in headers.items() if k.startswith("x-") or k == "traceparent"
    }
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
        lie = controls.prompt_usage
        reported = lie.reported(req.prompt_tokens) if lie is not None else None
        rec.prompt_tokens_reported = req.prompt_tokens if reported is None else reported
        plan = plan_answer(req, controls, cfg)
        rec.max_tokens = plan.limit
        rec.tokens_planned = plan.tokens_per_choice * req.choices
        await _before_answer(controls)
        default_type = "text/event-stream" if req.stream else "application/json"
        delivery = Delivery.choose(controls, headers, default_type, req.stream)
        delivery.record(rec)
        gen = Generation(
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
        delivery = Delivery.choose(controls, headers, "application/json", stream=False)
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


def add_routes(app: web.Application) -> None:
    """Register every route of the simulator on ``app``."""
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
