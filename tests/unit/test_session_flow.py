"""The processor driven with real ext_proc protobufs, for what issue 16 found wrong against a real
engine: final figures on the response carrying [DONE], a client closing right after it settled
as completed, one disagreement counted once, and a lagging lazy stream delivered up to its
quota before the cut."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.json_format import MessageToDict

from extproc.config import load_config_text
from extproc.core.lifecycle import Closed, CutReason, Ending
from extproc.core.meter import StreamMeter
from extproc.gateway import Gateway
from extproc.metrics import Metrics
from extproc.server.processor import RequestProcessor
from tests.unit.test_core_meter import usage_ev
from tests.unit.test_processor_flow import RULES, event, feed, headers, limiter, start

pytestmark = pytest.mark.unit

DONE = b"data: [DONE]\n\n"


def final_fields(resps: list[Any]) -> dict[str, Any] | None:
    """The ``ai_quota`` metadata of the last response carrying some."""
    found: dict[str, Any] | None = None
    for r in resps:
        if r.HasField("dynamic_metadata"):
            meta = MessageToDict(r.dynamic_metadata)
            found = meta.get("envoy.filters.http.ext_proc", meta)
    return found


def disagreements(proc: Any) -> float:
    """aiq_usage_disagreements_total, all directions."""
    total = 0.0
    for metric in proc.gw.metrics.usage_disagreements.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                total += sample.value
    return total


async def test_done_carries_the_final_figures_and_a_close_after_it_is_completed() -> None:
    """The response forwarding [DONE] carries output_tokens and ending completed; a client
    that closes before the upstream's end of stream is settled completed, once."""
    lim = limiter()
    proc = await start(lim)
    got: list[Any] = []
    for w in (" a", " b", " c"):
        got += await feed(proc, event(w))
    got += await feed(proc, usage_ev(8, 3) + DONE)  # no end_of_stream yet
    meta = final_fields(got)
    assert meta is not None
    flat = str(meta)
    assert "output_tokens" in flat and "completed" in flat
    proc.close(Closed.EOF)  # the client closed right after [DONE]
    await asyncio.gather(*proc.gw.background.pending)
    assert proc.s.life.ending is Ending.COMPLETED
    assert len(lim.settles) == 1


async def test_one_disagreement_is_counted_once() -> None:
    """An upstream reporting far too few tokens is logged and counted once, though the figure
    is read for the access log and again for settlement."""
    lim = limiter()
    proc = await start(lim)
    for i in range(40):
        await feed(proc, event(f" w{i}"))
    await feed(proc, usage_ev(8, 1) + DONE, end=True)
    await asyncio.gather(*proc.gw.background.pending)
    assert disagreements(proc) == 1


def test_lagging_lazy_stream_is_delivered_up_to_the_quota() -> None:
    """A backlog held behind an in-flight charge that exhausts the window is delivered up to
    the room the charge left, then cut (it was dropped whole before)."""
    m = StreamMeter(count=lambda t: len(t.split()), every=10, strict=False)

    def ev(n: int) -> bytes:
        obj = {"choices": [{"index": 0, "delta": {"content": " w" * n}}]}
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    step = m.feed(ev(10), False)  # 10 uncharged: a charge of 10 is asked
    assert step.charge == 10
    held = m.feed(ev(5) * 6, False)  # 30 more: past 2N while the charge is out -> held
    assert held.forward.count(b"data:") < 6
    # the charge answers: exhausted, 12 tokens of room left after it
    step = m.on_charge(10, True, room=12)
    if step.charge:  # the held events are charged before they go out
        step = m.on_charge(step.charge, True, room=12 - step.charge + m.held_tokens)
    assert step.cut_reason is CutReason.QUOTA_EXHAUSTED
    assert m.delivered > 10  # some of the backlog went out before the cut


async def test_lease_renewal_does_not_log_as_the_request_that_started_it() -> None:
    """Background tasks run in their own context: no request's bound log fields."""
    lim = limiter()
    proc = await start(lim)
    seen: list[dict[str, Any]] = []

    async def probe() -> None:
        seen.append(structlog.contextvars.get_contextvars())

    proc.gw.background._renew_loop = probe  # type: ignore[method-assign]
    proc.gw.background._leases = None
    structlog.contextvars.bind_contextvars(request_id="someone-else")
    try:
        proc.gw.background.keep_leases()
        assert proc.gw.background._leases is not None
        await proc.gw.background._leases
    finally:
        structlog.contextvars.clear_contextvars()
    assert seen == [{}]


def _chunk_with_usage(text: str, completion: int) -> bytes:
    """A chat chunk carrying the engine's running usage (continuous_usage_stats)."""
    obj = {
        "choices": [{"index": 0, "delta": {"content": text}}],
        "usage": {
            "prompt_tokens": 7,
            "completion_tokens": completion,
            "total_tokens": 7 + completion,
        },
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def test_engine_running_usage_is_what_the_meter_counts() -> None:
    """With the engine's running count in every chunk, a delta the recount would call 4 tokens
    (a partial UTF-8 sequence decoded as U+FFFD) counts as the 1 the engine generated; a chunk
    without usage falls back to the recount."""
    m = StreamMeter(count=lambda t: 4 * len(t), every=1000, strict=False, engine_counts=True)
    m.feed(_chunk_with_usage("\ufffd", 1), False)
    m.feed(_chunk_with_usage("\ufffd", 2), False)
    assert m.counted == 2
    m.feed(b'data: {"choices":[{"index":0,"delta":{"content":"ab"}}]}\n\n', False)
    assert m.counted == 2 + 8
    m.feed(_chunk_with_usage("c", 11), False)  # engine total 11: one more than counted
    assert m.counted == 11


def test_continuous_usage_is_requested_only_for_models_that_say_so() -> None:
    """stream_options.continuous_usage_stats is added for a model served by such an engine."""
    from extproc.core.apis.base import RequestLimits
    from extproc.core.apis.openai import CHAT

    raw = orjson.dumps(
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    )
    limits = RequestLimits(max_tokens_ceiling=100_000, max_n=8)
    plain = CHAT.rewrite(CHAT.parse(raw, limits), budget=None, force_usage=True, model=None)
    assert plain is not None and b"continuous_usage_stats" not in plain
    body = CHAT.rewrite(
        CHAT.parse(raw, limits), budget=None, force_usage=True, model=None, continuous_usage=True
    )
    assert body is not None
    assert orjson.loads(body)["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": True,
    }


def test_stream_usage_continuous_is_read_from_the_rules() -> None:
    """models.<name>.stream_usage: continuous marks the model as served by such an engine."""

    cfg = load_config_text(
        """
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 100, stream_usage: continuous}
  n: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 100}
plans:
  p: {limits: [{model: "*", per: hour, tpm: 1000}]}
tenants:
  t: {plan: p, keys: [{name: k, plaintext: sk-t}]}
"""
    )
    assert cfg.models["m"].continuous_usage and not cfg.models["n"].continuous_usage


async def test_a_json_body_disagreement_is_counted_once() -> None:
    """A non-streaming response whose usage is above the reserved maximum is counted and
    logged once, though its figure feeds the access log and settlement."""
    lim = limiter()
    cfg = load_config_text(RULES % ("lazy", 100_000))
    gw = Gateway(config=cfg, limiter=lim, clock=lim.inner.clock, metrics=Metrics())
    proc = RequestProcessor(gw)
    await proc.handle(
        pb.ProcessingRequest(
            request_headers=headers(
                {":path": "/v1/chat/completions", ":method": "POST", "authorization": "Bearer sk-t"}
            )
        )
    )
    body = orjson.dumps(
        {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    )
    await proc.handle(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    await proc.handle(
        pb.ProcessingRequest(
            response_headers=headers({":status": "200", "content-type": "application/json"})
        )
    )
    answer = orjson.dumps(
        {
            "choices": [],
            "usage": {"prompt_tokens": 8, "completion_tokens": 999, "total_tokens": 1007},
        }
    )
    [resp] = await proc.handle(
        pb.ProcessingRequest(response_body=pb.HttpBody(body=answer, end_of_stream=True))
    )
    assert "output_tokens" in str(final_fields([resp]))
    await asyncio.gather(*proc.gw.background.pending)
    assert disagreements(proc) == 1
