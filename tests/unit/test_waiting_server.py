"""Waiting, executed by the processor (real ext_proc protobufs, the in-memory limiter, the real
clock over 1 s windows): a request over its limit is held until its turn and admitted with
its wait recorded; a client that hangs up while held leaves the queue at once and the
replica's waiter count falls back; a replica holding its most waiters refuses at once, with
no ticket left behind; a drain whose grace ends before a waiter's turn answers it at once (a
429 with its turn as retry-after, its ticket gone), one whose grace covers the turn lets it be
admitted at its turn."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.clock import SystemClock
from extproc.config import load_config_text
from extproc.gateway import Gateway
from extproc.limiter.memory import MemoryLimiter
from extproc.metrics import Metrics
from extproc.server.processor import RequestProcessor

pytestmark = pytest.mark.unit

RULES = """
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 1000}
plans:
  p: {limits: [{model: "*", per: 1s, rpm: 1}], wait: {max_seconds: 5}}
requests: {max_waiters_per_replica: %d}
tenants:
  t: {plan: p, keys: [{name: k, plaintext: sk-t}]}
"""


def headers(pairs: dict[str, str]) -> Any:
    hh = pb.HttpHeaders()
    for k, v in pairs.items():
        hh.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    return hh


def gateway(cap: int = 1000) -> tuple[Gateway, MemoryLimiter]:
    lim = MemoryLimiter(SystemClock())
    cfg = load_config_text(RULES % cap)
    return Gateway(config=cfg, limiter=lim, clock=lim.clock, metrics=Metrics()), lim


async def ask(gw: Gateway, rid: str) -> tuple[RequestProcessor, Any]:
    """One request's headers and body: the processor and its answer to the body."""
    proc = RequestProcessor(gw)
    await proc.handle(
        pb.ProcessingRequest(
            request_headers=headers(
                {
                    ":path": "/v1/chat/completions",
                    ":method": "POST",
                    "authorization": "Bearer sk-t",
                    "x-request-id": rid,
                }
            )
        )
    )
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    [resp] = await proc.handle(
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    )
    return proc, resp


def fresh_second() -> None:
    """Start just after a 1 s window opens (the first request is admitted in it)."""
    time.sleep(1.0 - time.time() % 1.0 + 0.02)


async def test_a_held_request_is_admitted_at_its_turn_with_its_wait() -> None:
    gw, lim = gateway()
    fresh_second()
    _, first = await ask(gw, "r1")
    assert first.WhichOneof("response") == "request_body"
    t0 = time.time()
    proc, second = await ask(gw, "r2")
    assert second.WhichOneof("response") == "request_body"  # admitted, after the boundary
    assert int(t0) + 1 <= time.time() < int(t0) + 1.5
    rec = proc.s.admitted
    assert rec is not None and 0 < rec.waited_ms <= 1000
    assert ("x-ratelimit-waited-ms", str(rec.waited_ms)) in rec.headers
    assert gw.waiting == 0 and not any(lim.waiting.queues.values())


async def test_a_hang_up_while_held_leaves_the_queue() -> None:
    gw, lim = gateway()
    fresh_second()
    await ask(gw, "r1")
    held = asyncio.ensure_future(ask(gw, "r2"))
    while gw.waiting == 0:  # held for its turn
        await asyncio.sleep(0.01)
    assert sum(len(q) for q in lim.waiting.queues.values()) == 1
    held.cancel()  # Envoy cancels the stream: the client went away
    with pytest.raises(asyncio.CancelledError):
        await held
    for _ in range(5):
        await asyncio.sleep(0)
    assert sum(len(q) for q in lim.waiting.queues.values()) == 0
    assert gw.waiting == 0


async def test_a_full_replica_refuses_at_once() -> None:
    gw, lim = gateway(cap=0)
    fresh_second()
    await ask(gw, "r1")
    t0 = time.monotonic()
    _, resp = await ask(gw, "r2")
    assert time.monotonic() - t0 < 0.3
    assert resp.WhichOneof("response") == "immediate_response"
    assert resp.immediate_response.status.code == 429
    assert b"holds its most waiting requests" in resp.immediate_response.body
    for _ in range(5):
        await asyncio.sleep(0)
    assert sum(len(q) for q in lim.waiting.queues.values()) == 0


async def test_a_drain_ending_before_the_turn_answers_the_waiter_at_once() -> None:
    gw, lim = gateway()
    fresh_second()
    await ask(gw, "r1")
    held = asyncio.ensure_future(ask(gw, "r2"))
    while gw.waiting == 0:  # held for its turn (the next second)
        await asyncio.sleep(0.01)
    t0 = time.monotonic()
    gw.start_draining(0.0)  # SIGTERM's drain, with no grace left for the turn
    _, resp = await held
    assert time.monotonic() - t0 < 0.3  # not held until its turn, nor until the grace's end
    assert resp.WhichOneof("response") == "immediate_response"
    imm = resp.immediate_response
    assert imm.status.code == 429
    assert b"shutting down before its turn" in imm.body
    got = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
    assert 0 < float(got["retry-after-ms"]) <= 1000  # its turn: the next second
    assert int(got["x-ratelimit-waited-ms"]) >= 0
    for _ in range(5):
        await asyncio.sleep(0)
    assert sum(len(q) for q in lim.waiting.queues.values()) == 0
    assert gw.waiting == 0


async def test_a_drain_whose_grace_covers_the_turn_admits_at_the_turn() -> None:
    gw, lim = gateway()
    fresh_second()
    await ask(gw, "r1")
    t0 = time.time()
    held = asyncio.ensure_future(ask(gw, "r2"))
    while gw.waiting == 0:
        await asyncio.sleep(0.01)
    gw.start_draining(5.0)
    _, resp = await held
    assert resp.WhichOneof("response") == "request_body"  # admitted, at its turn
    assert int(t0) + 1 <= time.time() < int(t0) + 1.5
    assert gw.waiting == 0 and not any(lim.waiting.queues.values())


async def test_a_request_arriving_while_draining_does_not_wait_past_the_grace() -> None:
    gw, lim = gateway()
    fresh_second()
    await ask(gw, "r1")
    gw.start_draining(0.0)
    t0 = time.monotonic()
    _, resp = await ask(gw, "r2")
    assert time.monotonic() - t0 < 0.3
    assert resp.immediate_response.status.code == 429
    assert b"shutting down before its turn" in resp.immediate_response.body
    assert gw.waiting == 0
    for _ in range(5):
        await asyncio.sleep(0)
    assert sum(len(q) for q in lim.waiting.queues.values()) == 0
