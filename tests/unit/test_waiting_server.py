"""Waiting, executed by the processor (real ext_proc protobufs, the in-memory limiter, the real
clock over 1 s windows): a request over its limit is held until its turn and admitted with
its wait recorded; a client that hangs up while held leaves the queue at once and the
replica's waiter count falls back; a replica holding its most waiters refuses at once, with
no ticket left behind; a drain whose grace ends before a waiter's turn answers it at once (a
429 with its turn as retry-after, its ticket gone), one whose grace covers the turn lets it be
admitted at its turn; a team's RPM (a level) over its limit holds a request of a plan that waits
like the plan's own limit, and two tenants of one team waiting on it never exceed it."""

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


LEVEL_RULES = """
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 1000}
plans:
  p: {limits: [{model: "*", per: 1s, rpm: 100}], wait: {max_seconds: 5}}
organisations:
  o: {}
teams:
  tm: {organisation: o, limits: [{per: 1s, rpm: 1}]}
tenants:
  t: {plan: p, team: tm, keys: [{name: k, plaintext: sk-t}]}
  u: {plan: p, team: tm, keys: [{name: k2, plaintext: sk-u}]}
"""


def gateway(cap: int = 1000, rules: str = "") -> tuple[Gateway, MemoryLimiter]:
    lim = MemoryLimiter(SystemClock())
    cfg = load_config_text(rules or RULES % cap)
    return Gateway(config=cfg, limiter=lim, clock=lim.clock, metrics=Metrics()), lim


async def ask(gw: Gateway, rid: str, key: str = "sk-t") -> tuple[RequestProcessor, Any]:
    """One request's headers and body: the processor and its answer to the body."""
    proc = RequestProcessor(gw)
    await proc.handle(
        pb.ProcessingRequest(
            request_headers=headers(
                {
                    ":path": "/v1/chat/completions",
                    ":method": "POST",
                    "authorization": f"Bearer {key}",
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


async def test_a_teams_rpm_holds_a_request_of_a_plan_that_waits_until_its_turn() -> None:
    gw, lim = gateway(rules=LEVEL_RULES)
    fresh_second()
    _, first = await ask(gw, "r1")
    assert first.WhichOneof("response") == "request_body"
    t0 = time.time()
    proc, second = await ask(gw, "r2")  # the plan has room; the team (1 a second) has none
    assert second.WhichOneof("response") == "request_body"  # admitted, after the boundary
    assert int(t0) + 1 <= time.time() < int(t0) + 1.5
    rec = proc.s.admitted
    assert rec is not None and 0 < rec.waited_ms <= 1000
    assert gw.waiting == 0 and not any(lim.waiting.queues.values())


async def test_two_tenants_waiting_on_their_team_never_exceed_it() -> None:
    """Each tenant's queue counts its own waiters only: the team's room goes to whoever asks
    first at a boundary, the other's turn slips (it is told then); never beyond the team's
    limit, and with the wait long enough every request is served."""
    gw, _ = gateway(rules=LEVEL_RULES)
    fresh_second()
    admitted: list[float] = []

    async def one(rid: str, key: str) -> str | None:
        _, resp = await ask(gw, rid, key)
        kind: str | None = resp.WhichOneof("response")
        if kind == "request_body":
            admitted.append(time.time())
        return kind

    kinds = await asyncio.gather(*(one(f"r{i}", ("sk-t", "sk-u")[i % 2]) for i in range(4)))
    assert kinds == ["request_body"] * 4  # 4 requests within 5 s at 1 a second: all served
    per_second = [int(x) for x in admitted]
    assert len(set(per_second)) == 4, admitted  # one a second: the team's limit held


async def test_tenants_sharing_a_team_are_not_ordered_with_each_other() -> None:
    """The limitation docs/semantics.md states: t's waiter and u's newcomer are told the same
    turn on their team (each queue counts its own waiters); at that turn one is admitted and
    the other, whose next turn is past its 1.5 s wait, is refused after waiting."""
    gw, _ = gateway(rules=LEVEL_RULES.replace("max_seconds: 5", "max_seconds: 1.5"))
    fresh_second()
    await ask(gw, "r1", "sk-t")
    held = asyncio.ensure_future(ask(gw, "r2", "sk-t"))
    while gw.waiting == 0:
        await asyncio.sleep(0.01)
    _, u = await ask(gw, "r3", "sk-u")  # waits too: t's waiter is not in u's queue
    _, t = await held
    kinds = sorted(x.WhichOneof("response") for x in (t, u))
    assert kinds == ["immediate_response", "request_body"], (t, u)
    refused = t if t.WhichOneof("response") == "immediate_response" else u
    assert refused.immediate_response.status.code == 429
    assert b"Not queued after waiting" in refused.immediate_response.body
