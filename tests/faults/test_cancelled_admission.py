"""An admission cancelled while its call is in a stalled Redis (issue 23, defect 5): the client
went away (Envoy cancelled the gRPC stream) after the admission script was sent; Redis runs it
when it wakes, and the cancel the processor queued takes the charge back, once."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
import redis
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.clock import SystemClock
from extproc.config import load_config_text
from extproc.gateway import Gateway
from extproc.limiter.base import AdmitCall
from extproc.limiter.redis import RedisLimiter
from extproc.metrics import Metrics
from extproc.server.processor import RequestProcessor
from tests.faults.test_redis_stall import stall_in_thread, stalled
from tests.faults.test_slow_charge import headers
from tests.helpers import RedisServer

pytestmark = pytest.mark.faults

RULES = """
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 1000}
failure: {timeout_ms: 5000}
plans:
  p: {limits: [{model: "*", per: day, rpm: 1000, tpm: 1000000}]}
tenants:
  t: {plan: p, keys: [{name: k, plaintext: sk-t}]}
"""


async def test_a_cancelled_admission_is_taken_back(own_redis: RedisServer) -> None:
    """Redis sleeps 0.8 s; an admission sent into it is cancelled (its request's stream
    closed).  Redis runs the script when it wakes; the queued cancel then refunds every
    counter it charged and frees the ledger's reservation: the tenant pays nothing."""
    lim = RedisLimiter.from_url(own_redis.url, timeout_ms=5000)
    gw = Gateway(
        config=load_config_text(RULES), limiter=lim, clock=SystemClock(), metrics=Metrics()
    )
    r = redis.Redis(port=own_redis.port)
    # the admission script loaded (EVALSHA finds it) and a pooled connection made, before
    # the stall
    warm = await lim.admit(
        AdmitCall("aiq:{w}:req:0", [], tpm_charged=0, count_refused=False, ledger_ttl_ms=1)
    )
    assert warm.admitted
    proc = RequestProcessor(gw)
    await proc.handle(
        pb.ProcessingRequest(
            request_headers=headers(
                {
                    ":path": "/v1/chat/completions",
                    ":method": "POST",
                    "authorization": "Bearer sk-t",
                    "x-request-id": "cancelled-1",
                }
            )
        )
    )
    body = orjson.dumps(
        {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
    )
    stall = stall_in_thread(own_redis.port, ["DEBUG", "SLEEP", "0.8"], 0.0)
    await stalled(own_redis.port)
    admitting = asyncio.ensure_future(
        proc.handle(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    )
    deadline = time.monotonic() + 5
    while lim.pool_in_use() == 0:  # the script is on its way to Redis
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)
    admitting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await admitting
    stall.join(10)
    ledger = proc.s.ledger
    deadline = time.monotonic() + 10
    while r.hget(ledger, "state") != b"settled":  # the script ran, then the cancel
        assert time.monotonic() < deadline, r.hgetall(ledger)
        await asyncio.sleep(0.02)
    counters = list(r.scan_iter("aiq:{t}:tpm:*")) + list(r.scan_iter("aiq:{t}:rpm:*"))
    assert counters  # the admission ran after all
    assert [int(r.get(k) or 0) for k in counters] == [0] * len(counters)
    assert r.zcard("aiq:{t}:open") == 0
    await gw.background.drain_settlements(2)
    await lim.close()
