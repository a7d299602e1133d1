"""A stream charge slower than the processor's wait at the stream's end (issue 23, defect 3):
the stream ends while its last charge is stuck in a stalled Redis (DEBUG SLEEP on a real
redis-server), the processor gives up waiting for it after 1 s and settles; whether Redis then
runs the charge before the settlement or after it, the output is counted once."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest
import redis
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.clock import SystemClock
from extproc.config import load_config_text
from extproc.gateway import Gateway
from extproc.limiter.redis import RedisLimiter
from extproc.metrics import Metrics
from extproc.server.processor import RequestProcessor
from tests.faults.test_redis_stall import stall_in_thread, stalled
from tests.helpers import RedisServer

pytestmark = pytest.mark.faults

RULES = """
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 1000}
charging: {charge_every_tokens: 4}
failure: {timeout_ms: 5000}
plans:
  p: {limits: [{model: "*", per: day, rpm: 1000, tpm: 1000000}]}
tenants:
  t: {plan: p, keys: [{name: k, plaintext: sk-t}]}
"""


def headers(pairs: dict[str, str]) -> Any:
    hh = pb.HttpHeaders()
    for k, v in pairs.items():
        hh.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    return hh


def event(word: str) -> bytes:
    obj = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": word}}]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def feed(proc: RequestProcessor, chunk: bytes, end: bool = False) -> list[Any]:
    return await proc.handle(
        pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end))
    )


async def streaming(gw: Gateway, request_id: str) -> RequestProcessor:
    """A processor whose request was admitted and whose SSE response has started."""
    proc = RequestProcessor(gw)
    await proc.handle(
        pb.ProcessingRequest(
            request_headers=headers(
                {
                    ":path": "/v1/chat/completions",
                    ":method": "POST",
                    "authorization": "Bearer sk-t",
                    "x-request-id": request_id,
                }
            )
        )
    )
    body = orjson.dumps(
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    )
    await proc.handle(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    [resp] = await proc.handle(
        pb.ProcessingRequest(
            response_headers=headers({":status": "200", "content-type": "text/event-stream"})
        )
    )
    assert resp.mode_override.response_body_mode == 4  # FULL_DUPLEX_STREAMED
    return proc


async def test_a_charge_slower_than_the_end_wait_is_counted_once(own_redis: RedisServer) -> None:
    """Redis sleeps 1.6 s with the stream's last charge queued in it: the stream ends, the
    processor waits 1 s for the charge, then settles (its settlement queues behind the
    charge).  The counter ends at exactly the request's final figure: the charge's tokens
    once, not twice."""
    lim = RedisLimiter.from_url(own_redis.url, timeout_ms=5000)
    gw = Gateway(
        config=load_config_text(RULES), limiter=lim, clock=SystemClock(), metrics=Metrics()
    )
    r = redis.Redis(port=own_redis.port)
    proc = await streaming(gw, "slow-1")
    for _ in range(3):
        await feed(proc, event(" w"))  # under one charge's worth: nothing charged yet
        await asyncio.sleep(0)
    stall = stall_in_thread(own_redis.port, ["DEBUG", "SLEEP", "1.6"], 0.0)
    await stalled(own_redis.port)
    await feed(proc, event(" w") + event(" w"))  # a charge starts, into the stalled Redis
    assert proc.driver is not None and proc.driver._task is not None
    await feed(proc, b"data: [DONE]\n\n", end=True)
    assert proc.s.life.ended
    started = time.monotonic()
    while gw.background.pending and time.monotonic() - started < 10:  # the settlement task
        await asyncio.sleep(0.02)
    stall.join(10)
    await gw.background.drain_settlements(5)
    ledger = proc.s.ledger
    assert r.hget(ledger, "state") == b"settled"
    assert int(r.hget(ledger, "seq") or 0) == 1  # the slow charge ran, before the settlement
    final = proc.s.settlement(0)
    assert final.total is not None
    tpm = list(r.scan_iter("aiq:{t}:tpm:t:*"))
    assert [int(r.get(k) or 0) for k in tpm] == [final.total]
    await lim.close()
