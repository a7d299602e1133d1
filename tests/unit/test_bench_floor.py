"""The do-nothing floor processor answers the same ext_proc messages as the real processor,
with the same kinds of reply and the same ``mode_override`` (what makes it a fair baseline)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.bench.floor import FloorStream
from extproc.clock import FakeClock
from extproc.config import load_config_text
from extproc.core.lifecycle import Closed
from extproc.gateway import Gateway
from extproc.limiter.memory import MemoryLimiter
from extproc.metrics import Metrics
from extproc.server.processor import RequestProcessor

pytestmark = pytest.mark.unit

RULES = """
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 1000}
plans:
  p: {limits: [{model: "*", per: hour, rpm: 100, tpm: 100000}]}
tenants:
  t: {plan: p, keys: [{name: k, plaintext: sk-t}]}
"""


def _headers(pairs: dict[str, str], *, eos: bool = False) -> Any:
    hh = pb.HttpHeaders(end_of_stream=eos)
    for k, v in pairs.items():
        hh.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    return hh


def _exchange(stream: bool, status: str, ctype: str, body: list[bytes]) -> list[Any]:
    """The ProcessingRequests Envoy sends for one chat completion and its response."""
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    if stream:
        request["stream"] = True
    msgs = [
        pb.ProcessingRequest(
            request_headers=_headers(
                {
                    ":path": "/v1/chat/completions",
                    ":method": "POST",
                    "authorization": "Bearer sk-t",
                    "content-type": "application/json",
                }
            )
        ),
        pb.ProcessingRequest(
            request_body=pb.HttpBody(body=orjson.dumps(request), end_of_stream=True)
        ),
        pb.ProcessingRequest(
            response_headers=_headers({":status": status, "content-type": ctype}, eos=not body)
        ),
    ]
    for i, chunk in enumerate(body):
        last = i == len(body) - 1
        msgs.append(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=last)))
    return msgs


def _json_body() -> list[bytes]:
    doc = orjson.dumps(
        {
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "a b c"}}],
            "usage": {"prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11},
        }
    )
    return [doc[:20], doc[20:]]


def _sse_body() -> list[bytes]:
    chunk = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": "x"}}],
    }
    ev = b"data: " + orjson.dumps(chunk) + b"\n\n"
    return [ev, ev, b"data: [DONE]\n\n"]


def _shape(resp: Any) -> tuple[str, str]:
    """What Envoy acts on besides mutations: the reply's kind and its mode override."""
    which = resp.WhichOneof("response")
    return which, str(resp.mode_override) if resp.HasField("mode_override") else ""


@pytest.mark.parametrize(
    ("stream", "status", "ctype", "body"),
    [
        (False, "200", "application/json", _json_body()),
        (False, "200", "application/json", []),
        (False, "500", "application/json", [b'{"error": {"message": "boom"}}']),
        (True, "200", "text/event-stream", _sse_body()),
        (True, "429", "application/json", [b'{"error": {"message": "slow down"}}']),
    ],
    ids=["json", "json-no-body", "upstream-500", "sse", "sse-upstream-429"],
)
async def test_floor_answers_like_the_processor(
    stream: bool, status: str, ctype: str, body: list[bytes]
) -> None:
    """Reply kinds and mode overrides match message by message; stream bodies pass whole."""
    cfg = load_config_text(RULES)
    clock = FakeClock()
    gw = Gateway(config=cfg, limiter=MemoryLimiter(clock), clock=clock, metrics=Metrics())
    real = RequestProcessor(gw)
    floor = FloorStream()
    real_shapes: list[tuple[str, str]] = []
    floor_shapes: list[tuple[str, str]] = []
    real_out = floor_out = b""
    for msg in _exchange(stream, status, ctype, body):
        replies = await real.handle(msg)
        reply = floor.answer(msg)
        assert reply is not None
        # the real processor may hold a stream's events back and answer several at once;
        # only the last reply to a message carries the message's kind in that case too
        real_shapes.append(_shape(replies[-1]))
        floor_shapes.append(_shape(reply))
        for r in replies:
            real_out += r.response_body.response.body_mutation.streamed_response.body
        floor_out += reply.response_body.response.body_mutation.streamed_response.body
    real.close(Closed.EOF)
    await asyncio.gather(*gw.background.pending)
    assert floor_shapes == real_shapes
    assert any(mode for _, mode in real_shapes) == (status == "200" and bool(body))
    duplex = stream and status == "200"
    assert floor_out == real_out == (b"".join(body) if duplex else b"")
