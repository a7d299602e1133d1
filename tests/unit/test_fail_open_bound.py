"""Fail-open on the bound path (issue 23, defect 7): a request admitted unmetered because Redis
failed, after admission had chosen the byte bound of its input, is never counted: nothing is
charged, so nothing needs the exact figure."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.clock import FakeClock
from extproc.config import load_config_text
from extproc.core.lifecycle import Closed
from extproc.gateway import Gateway
from extproc.limiter.memory import MemoryLimiter
from extproc.metrics import Metrics
from extproc.server.processor import RequestProcessor
from tests.limiters import RecordingLimiter

pytestmark = pytest.mark.unit

RULES = """
requests: {admit_on_bound: true}
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 1000}
plans:
  open: {limits: [{model: "*", per: hour, rpm: 100, tpm: 1000000}], failure_mode: open}
tenants:
  o: {plan: open, keys: [{name: ko, plaintext: sk-o}]}
"""


def headers(pairs: dict[str, str], eos: bool = False) -> Any:
    hh = pb.HttpHeaders(end_of_stream=eos)
    for k, v in pairs.items():
        hh.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    return hh


async def request(gw: Gateway) -> RequestProcessor:
    """One non-streaming request, answered 200 without usage, to its settlement."""
    proc = RequestProcessor(gw)
    await proc.handle(
        pb.ProcessingRequest(
            request_headers=headers(
                {":path": "/v1/chat/completions", ":method": "POST", "authorization": "Bearer sk-o"}
            )
        )
    )
    body = orjson.dumps(
        {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hello " * 50}]}
    )
    await proc.handle(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    await proc.handle(
        pb.ProcessingRequest(
            response_headers=headers({":status": "200", "content-type": "application/json"})
        )
    )
    answer = orjson.dumps({"object": "chat.completion", "choices": []})
    await proc.handle(
        pb.ProcessingRequest(response_body=pb.HttpBody(body=answer, end_of_stream=True))
    )
    proc.close(Closed.EOF)
    for task in list(gw.background.pending):
        await task
    return proc


async def test_fail_open_on_the_bound_path_counts_nothing() -> None:
    clock = FakeClock()
    lim = RecordingLimiter(MemoryLimiter(clock))  # .down: every call fails
    metrics = Metrics()
    gw = Gateway(config=load_config_text(RULES), limiter=lim, clock=clock, metrics=metrics)

    def counts() -> float:
        return metrics.registry.get_sample_value("aiq_tokenize_seconds_count", {"api": "chat"}) or 0

    await request(gw)  # counted first: nothing known of the counters yet
    assert counts() == 1
    lim.down = True
    proc = await request(gw)  # on the bound, then Redis fails: admitted unmetered
    assert metrics.registry.get_sample_value("aiq_input_admissions_total", {"how": "bound"}) == 1
    assert proc.s.cost is None  # nothing charged
    assert counts() == 1  # and nothing counted, at admission or at settlement
