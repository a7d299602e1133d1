"""A settlement backlog at its limit (issue 23, defect 6): Redis takes no settlement, the
backlog reaches ``max_backlog``; nothing is dropped, and admissions are pushed back per the
plan's failure mode (closed: a 503; open: passed unmetered), counted in
``aiq_settlement_pushback_total``."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.clock import FakeClock
from extproc.config import load_config_text
from extproc.gateway import Gateway
from extproc.limiter.base import SettleCall
from extproc.limiter.batch import BatchSettings
from extproc.limiter.memory import MemoryLimiter
from extproc.metrics import Metrics
from extproc.server.processor import RequestProcessor

pytestmark = pytest.mark.unit

RULES = """
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 1000}
plans:
  closed: {limits: [{model: "*", per: hour, rpm: 100, tpm: 100000}]}
  open: {limits: [{model: "*", per: hour, rpm: 100, tpm: 100000}], failure_mode: open}
tenants:
  c: {plan: closed, keys: [{name: kc, plaintext: sk-c}]}
  o: {plan: open, keys: [{name: ko, plaintext: sk-o}]}
"""


class Behind(MemoryLimiter):
    """Redis that takes no settlement (every batched call fails)."""

    async def settle_many(self, items: list[SettleCall]) -> list[bool | None]:
        return [None] * len(items)


def headers(pairs: dict[str, str]) -> Any:
    hh = pb.HttpHeaders()
    for k, v in pairs.items():
        hh.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    return hh


async def admit(gw: Gateway, key: str) -> Any:
    proc = RequestProcessor(gw)
    await proc.handle(
        pb.ProcessingRequest(
            request_headers=headers(
                {":path": "/v1/chat/completions", ":method": "POST", "authorization": key}
            )
        )
    )
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    [resp] = await proc.handle(
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    )
    return resp


async def test_a_full_backlog_drops_nothing_and_pushes_back_on_admissions() -> None:
    lim = Behind(FakeClock())
    metrics = Metrics()
    gw = Gateway(
        config=load_config_text(RULES),
        limiter=lim,
        clock=lim.clock,
        metrics=metrics,
        batch_settings=BatchSettings(
            tick_s=0.0, max_batch=2, max_backlog=4, backoff_s=60.0, max_backoff_s=60.0
        ),
    )
    assert (await admit(gw, "Bearer sk-c")).WhichOneof("response") == "request_body"
    for i in range(6):  # requests in flight settle past the limit: kept, none dropped
        gw.background.submit_settlement(SettleCall(f"aiq:{{c}}:req:{i}", [], 60_000))
    batcher = gw.background.settle_batcher
    assert batcher is not None and len(batcher) == 6
    assert gw.background.settlements_full()
    refused = await admit(gw, "Bearer sk-c")
    assert refused.WhichOneof("response") == "immediate_response"
    assert refused.immediate_response.status.code == 503
    assert orjson.loads(refused.immediate_response.body)["error"]["code"] == (
        "quota_backend_unavailable"
    )
    passed = await admit(gw, "Bearer sk-o")  # failing open: admitted, unmetered
    assert passed.WhichOneof("response") == "request_body"
    assert lim.round_trips == 1  # neither went to Redis
    sample = metrics.registry.get_sample_value
    assert sample("aiq_settlement_pushback_total", {"outcome": "refused"}) == 1
    assert sample("aiq_settlement_pushback_total", {"outcome": "unmetered"}) == 1
    assert sample("aiq_settlements_total", {"outcome": "dropped"}) is None
    assert len(batcher) == 6
    await batcher.close(0.01)
