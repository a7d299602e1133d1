"""Local allowances on the real request path: the ext_proc servicer on a grpc.aio server with
the allowance wrapper around the in-memory limiter (fake clock).  Far from the limit the
requests are admitted and settled without a limiter call, the answers carry the rate-limit
headers, and the counters end exact."""

from __future__ import annotations

import asyncio

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc._gen.aiquota.v1 import usage_pb2, usage_pb2_grpc
from extproc.clock import FakeClock
from extproc.config import load_config_text
from extproc.core.keys import windowed
from extproc.gateway import Gateway
from extproc.limiter.allowance import AllowanceLimiter, AllowanceSettings
from extproc.limiter.memory import MemoryLimiter
from extproc.metrics import Metrics
from extproc.server.servicer import ExternalProcessorServicer
from extproc.usage.service import add_usage_service
from tests.integration.test_servicer_inprocess import (
    Call,
    meta,
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
  p: {limits: [{model: "*", per: minute, rpm: 10000, tpm: 10000000}]}
tenants:
  t: {plan: p, keys: [{name: k, plaintext: sk-t}]}
"""


async def test_requests_far_from_the_limit_skip_the_limiter() -> None:
    clock = FakeClock()
    store = MemoryLimiter(clock)
    lim = AllowanceLimiter(store, AllowanceSettings(min_rate=4), clock=clock, metrics=Metrics())
    cfg = load_config_text(RULES)
    gw = Gateway(config=cfg, limiter=lim, clock=clock, metrics=lim.metrics or Metrics())
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessorServicer(gw), server)
    add_usage_service(server, gw)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ExternalProcessorStub(channel)
    usage = usage_pb2_grpc.UsageStub(channel)

    async def one() -> dict[str, str]:
        c = Call(stub)
        await c.send(req_headers())
        await c.send(req_body(max_tokens=50))
        [h] = await c.send(resp_headers())
        body = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7}})
        [end] = await c.send(resp_body(body, end=True))
        assert meta(end)["ending"] == "completed"
        await c.close()
        mut = h.response_headers.response.header_mutation
        return {x.header.key: x.header.raw_value.decode() for x in mut.set_headers}

    try:
        for _ in range(20):  # warm up: the bucket's rate is seen, allowances are taken
            await one()
            await asyncio.sleep(0.01)
        trips = store.round_trips
        for _ in range(100):
            headers = await one()
            # the room left, net of every allowance held (they count as used)
            remaining = int(headers["x-ratelimit-remaining-tokens"])
            assert 0 < remaining < 10_000_000
        while gw.active:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the settlement batcher's tick
        assert (store.round_trips - trips) / 100 <= 0.1
        assert lim.stats.local_admissions >= 100
        assert lim.stats.local_settlements >= 100
        tenant = cfg.tenants["t"]
        keys = [
            b.key
            for b in windowed("aiq", "t", "k", list(tenant.limits), clock.now_ms())
            if b.kind != "concurrency"
        ]
        while lim.book.tasks or lim.book.returns:  # no take or give-back in flight
            await asyncio.sleep(0.01)
        # Before any give-back: the counters hold the allowance pre-debited for this replica
        # on top of what the requests used; the usage API shows the requests' use alone.
        gross = dict(zip(keys, await store.read(keys), strict=True))
        assert sum(lim.held().values()) > 0
        assert all(gross[k] == 120 * n + lim.held().get(k, 0) for k, n in _per_request(keys))
        got = await usage.GetUsage(usage_pb2.GetUsageRequest(tenant="t"))
        used = {b.metric: b.used for b in got.buckets}
        assert used == {"rpm": 120, "tpm": 120 * (9 + 7)}
        assert {b.metric: b.remaining for b in got.buckets} == {
            "rpm": 10_000 - 120,
            "tpm": 10_000_000 - 120 * 16,
        }
        await lim.give_back()
        values = dict(zip(keys, await store.read(keys), strict=True))
        rpm = next(v for k, v in values.items() if ":rpm:" in k)
        tpm = next(v for k, v in values.items() if ":tpm:" in k)
        assert rpm == 120
        assert tpm == 120 * (9 + 7)  # each request's input and output, exactly
    finally:
        await channel.close()
        await server.stop(None)
        await lim.close()


def _per_request(keys: list[str]) -> list[tuple[str, int]]:
    """Each counter with what one of the test's requests adds to it (1 request, 16 tokens)."""
    return [(k, 1 if ":rpm:" in k else 16) for k in keys]
