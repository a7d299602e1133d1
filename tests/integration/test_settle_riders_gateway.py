"""Settlements riding on the next admission, through the real ext_proc servicer on a real
redis-server: N non-streaming requests in a row cost N admission calls and no settle call of
their own, and the counters equal the truth once drained."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.clock import SystemClock
from extproc.config import load_config_text
from extproc.gateway import Gateway
from extproc.limiter.batch import BatchSettings
from extproc.limiter.redis import RedisLimiter
from extproc.metrics import Metrics
from extproc.server.servicer import ExternalProcessorServicer
from tests.helpers import RedisServer
from tests.integration.test_servicer_inprocess import (
    Call,
    req_body,
    req_headers,
    resp_body,
    resp_headers,
)

pytestmark = pytest.mark.integration

RULES = """
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 1000}
plans:
  p: {limits: [{model: "*", per: minute, rpm: 1000, tpm: 10000000}]}
tenants:
  %s: {plan: p, keys: [{name: k, plaintext: sk-t}]}
"""


class Served:
    """A servicer on a gRPC server over Redis: its gateway, limiter and a client stub."""

    def __init__(self, gw: Gateway, lim: RedisLimiter, stub: Any, tenant: str) -> None:
        self.gw, self.lim, self.stub, self.tenant = gw, lim, stub, tenant


@pytest.fixture
async def srv(redis_server: RedisServer) -> AsyncIterator[Served]:
    """The servicer with a settlement tick of an hour: a settlement not carried by an
    admission waits for the drain, so what rode is what was applied before it."""
    tenant = f"ride{uuid.uuid4().hex[:8]}"
    lim = RedisLimiter.from_url(redis_server.url, timeout_ms=2000)
    gw = Gateway(
        config=load_config_text(RULES % tenant),
        limiter=lim,
        clock=SystemClock(),
        metrics=Metrics(),
        batch_settings=BatchSettings(tick_s=3600.0),
    )
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessorServicer(gw), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Served(gw, lim, pb_grpc.ExternalProcessorStub(channel), tenant)
    finally:
        await channel.close()
        await server.stop(None)
        await gw.background.drain_settlements(5.0)
        await lim.close()


async def one_request(srv: Served, i: int, completion: int) -> None:
    """A non-streaming request whose JSON answer reports ``completion`` output tokens."""
    c = Call(srv.stub)
    await c.send(req_headers(**{"x-request-id": f"r{i}"}))
    await c.send(req_body(max_tokens=200))
    await c.send(resp_headers())
    body = orjson.dumps(
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": completion}}
    )
    await c.send(resp_body(body, end=True))
    await c.close()


def sample(metric: Any, **labels: str) -> float:
    """A counter's value (0 when never incremented)."""
    for m in metric.collect():
        for s in m.samples:
            if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


async def test_settlements_ride_on_the_next_admission(
    srv: Served, redis_server: RedisServer
) -> None:
    """20 requests in a row: 20 round trips (each admission carrying the previous request's
    settlement), 19 settlements applied before the drain, the last one by it; then the TPM
    counter equals the tokens the requests were charged and every reservation is closed."""
    n = 20
    r = redis_server.client()
    r.config_resetstat()
    before = srv.lim.round_trips
    for i in range(n):
        await one_request(srv, i, completion=3 + i)
    calls = r.info("commandstats")
    # admissions only: no settle call of its own (besides the once-a-second read of the
    # input shortcut's stops, an HKEYS, while requests are admitted on a bound)
    stops_reads = int(calls.get("cmdstat_hkeys", {}).get("calls", 0))
    assert stops_reads <= 1
    assert srv.lim.round_trips - before - stops_reads == n
    assert sample(srv.gw.metrics.settlements, outcome="applied") == n - 1
    batcher = srv.gw.background.settle_batcher
    assert batcher is not None and len(batcher) == 1 and batcher.calls == 0
    await srv.gw.background.drain_settlements(5.0)
    assert batcher.calls == 1
    assert sample(srv.gw.metrics.settlements, outcome="applied") == n
    # script calls Redis ran (a first NOSCRIPT answer, before the script is loaded, is not one)
    evalsha = calls["cmdstat_evalsha"]
    assert int(evalsha["calls"]) - int(evalsha["failed_calls"]) == n
    tag = f"aiq:{{{srv.tenant}}}"
    tpm = [k for k in r.keys(f"{tag}*") if "tpm" in k]
    assert len(tpm) == 1
    charged = sample(srv.gw.metrics.tokens, kind="net")
    assert charged == sum(9 + 3 + i for i in range(n))
    assert int(r.get(tpm[0]) or 0) == charged
    assert r.zcard(f"{tag}:open") == 0
