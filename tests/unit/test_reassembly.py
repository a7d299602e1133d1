"""The exact path's reassembly, sans-IO: for any split of the upstream's SSE bytes, the JSON
rebuilt for a non-streaming client says what the stream said (chat choices, tool calls merged
by index, completions text and logprobs, the Responses terminal object, Messages content
blocks with their tool input); and the processor, driven with real ext_proc messages, sends
a non-stream upstream as a stream and forwards nothing but the rebuilt JSON at its end, while
an abandoned one settles on what passed."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.config import load_config_text
from extproc.config.load import ConfigError
from extproc.core.apis.messages import MESSAGES, assemble_message
from extproc.core.apis.openai import CHAT, COMPLETIONS
from extproc.core.apis.openai.reassemble import assemble_chat
from extproc.core.apis.reassembly import BufferedStream, decoded_events, stream_events
from extproc.core.apis.responses import RESPONSES
from extproc.core.lifecycle import Closed, Ending
from extproc.gateway import Gateway
from extproc.metrics import Metrics
from extproc.server.processor import RequestProcessor
from tests.limiters import RecordingLimiter
from tests.unit.test_processor_flow import headers, limiter

pytestmark = pytest.mark.unit


def sse(objs: list[dict[str, Any]], *, named: bool = False, done: bool = True) -> bytes:
    out = b""
    for o in objs:
        if named:
            out += b"event: " + str(o["type"]).encode() + b"\n"
        out += b"data: " + orjson.dumps(o) + b"\n\n"
    return out + (b"data: [DONE]\n\n" if done else b"")


def fed(rs: BufferedStream, raw: bytes, cuts: list[int]) -> dict[str, Any]:
    """Feed ``raw`` split at ``cuts``; the rebuilt body, parsed."""
    at = 0
    for c in sorted(set(cuts)):
        rs.feed(raw[at:c])
        at = c
    rs.feed(raw[at:])
    out: dict[str, Any] = orjson.loads(rs.body())
    return out


def pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(bounds) if text[a:b]]


texts = st.text(min_size=0, max_size=40)
splits = st.lists(st.integers(min_value=0, max_value=4000), max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    contents=st.lists(texts, min_size=1, max_size=3),
    args=texts,
    cuts=splits,
    byte_cuts=splits,
)
def test_chat_choices_and_tool_calls_are_rebuilt(
    contents: list[str], args: str, cuts: list[int], byte_cuts: list[int]
) -> None:
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    chunks: list[dict[str, Any]] = []
    for i, text in enumerate(contents):
        chunks.append({**head, "choices": [{"index": i, "delta": {"role": "assistant"}}]})
        for p in pieces(text, cuts):  # choices interleave as an engine's would
            chunks.append({**head, "choices": [{"index": i, "delta": {"content": p}}]})
    tool = [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}]
    chunks.append({**head, "choices": [{"index": 0, "delta": {"tool_calls": tool}}]})
    for p in pieces(args, cuts):
        delta = {"tool_calls": [{"index": 0, "function": {"arguments": p}}]}
        chunks.append({**head, "choices": [{"index": 0, "delta": delta}]})
    for i in range(len(contents)):
        chunks.append({**head, "choices": [{"index": i, "delta": {}, "finish_reason": "stop"}]})
    usage = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}
    chunks.append({**head, "choices": [], "usage": usage, "system_fingerprint": "fp"})
    got = fed(CHAT.reassembler(), sse(chunks), byte_cuts)
    assert got["object"] == "chat.completion" and got["id"] == "c1" and got["created"] == 7
    assert got["usage"] == usage and got["system_fingerprint"] == "fp"
    assert [c["index"] for c in got["choices"]] == list(range(len(contents)))
    for i, text in enumerate(contents):
        msg = got["choices"][i]["message"]
        assert msg["role"] == "assistant"
        assert msg["content"] == (text or None)
        assert got["choices"][i]["finish_reason"] == "stop"
    call = got["choices"][0]["message"]["tool_calls"]
    assert call == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": args}}
    ]


@settings(max_examples=100, deadline=None)
@given(text=texts, cuts=splits, byte_cuts=splits)
def test_completions_text_and_logprobs_are_rebuilt(
    text: str, cuts: list[int], byte_cuts: list[int]
) -> None:
    parts = pieces(text, cuts)
    chunks = [
        {
            "id": "x",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "text": p,
                    "logprobs": {
                        "tokens": [p],
                        "token_logprobs": [-0.5],
                        "top_logprobs": [{p: -0.5}],
                        "text_offset": [k],
                    },
                    "finish_reason": None,
                }
            ],
        }
        for k, p in enumerate(parts)
    ]
    chunks.append({"id": "x", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    got = fed(COMPLETIONS.reassembler(), sse(chunks), byte_cuts)
    (choice,) = got["choices"]
    assert got["object"] == "text_completion"
    assert choice["text"] == text and choice["finish_reason"] == "length"
    if parts:
        assert choice["logprobs"]["tokens"] == parts
        assert choice["logprobs"]["text_offset"] == list(range(len(parts)))


@settings(max_examples=100, deadline=None)
@given(text=texts, args=texts, cuts=splits, byte_cuts=splits)
def test_messages_blocks_are_rebuilt(
    text: str, args: str, cuts: list[int], byte_cuts: list[int]
) -> None:
    tool_input = {"q": args, "n": 3}
    raw_input = orjson.dumps(tool_input).decode()
    events: list[dict[str, Any]] = [
        {
            "type": "message_start",
            "message": {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": "m",
                "stop_reason": None,
                "usage": {"input_tokens": 5, "output_tokens": 1},
            },
        },
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "thinking", "thinking": ""},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "thinking_delta", "thinking": "hm"},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "signature_delta", "signature": "sig"},
        },
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        *(
            {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": p}}
            for p in pieces(text, cuts)
        ),
        {"type": "content_block_stop", "index": 1},
        {
            "type": "content_block_start",
            "index": 2,
            "content_block": {"type": "tool_use", "id": "tu_1", "name": "f", "input": {}},
        },
        *(
            {
                "type": "content_block_delta",
                "index": 2,
                "delta": {"type": "input_json_delta", "partial_json": p},
            }
            for p in pieces(raw_input, cuts)
        ),
        {"type": "content_block_stop", "index": 2},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            "usage": {"output_tokens": 40},
        },
        {"type": "message_stop"},
    ]
    got = fed(MESSAGES.reassembler(), sse(events, named=True, done=False), byte_cuts)
    assert got["id"] == "msg_1" and got["stop_reason"] == "tool_use"
    assert got["usage"] == {"input_tokens": 5, "output_tokens": 40}
    assert got["content"] == [
        {"type": "thinking", "thinking": "hm", "signature": "sig"},
        {"type": "text", "text": text},
        {"type": "tool_use", "id": "tu_1", "name": "f", "input": tool_input},
    ]


def test_responses_take_the_terminal_events_object() -> None:
    final = {"id": "resp_1", "object": "response", "status": "completed", "output": [1]}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}},
        {"type": "response.output_text.delta", "delta": "hi"},
        {"type": "response.completed", "response": final},
    ]
    assert fed(RESPONSES.reassembler(), sse(events, named=True, done=False), []) == final


def test_an_upstream_error_event_becomes_the_error_body() -> None:
    err = {"message": "boom", "type": "server_error"}
    assert assemble_chat(stream_events(sse([{"error": err}]))) == {"error": err}
    anth = sse([{"type": "error", "error": err}], named=True, done=False)
    assert assemble_message(stream_events(anth)) == {"type": "error", "error": err}


def test_embeddings_never_reassemble() -> None:
    from extproc.core.apis.embeddings import EMBEDDINGS
    from extproc.core.apis.openai.request import parse_request

    req = parse_request(
        b'{"model": "m", "prompt": "x", "best_of": 2}',
        "completions",
        max_tokens_ceiling=10,
        max_n=4,
    )
    assert not COMPLETIONS.reassembles(req)  # best_of cannot stream
    assert EMBEDDINGS.can_stream is False


# -- the processor, message by message ---------------------------------------------------

RULES = """
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 1000%s}
charging: {charge_every_tokens: 4}
plans:
  p: {limits: [{model: "*", per: hour, rpm: 100, tpm: 100000}]}
tenants:
  t: {plan: p, keys: [{name: k, plaintext: sk-t}]}
"""


async def admitted(lim: RecordingLimiter, extra: str = "") -> tuple[RequestProcessor, Any]:
    cfg = load_config_text(RULES % extra)
    gw = Gateway(config=cfg, limiter=lim, clock=lim.inner.clock, metrics=Metrics())
    proc = RequestProcessor(gw)
    await proc.handle(
        pb.ProcessingRequest(
            request_headers=headers(
                {":path": "/v1/chat/completions", ":method": "POST", "authorization": "Bearer sk-t"}
            )
        )
    )
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    [resp] = await proc.handle(
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    )
    return proc, resp


def chunk(word: str) -> bytes:
    c = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return (
        b"data: "
        + orjson.dumps({**c, "choices": [{"index": 0, "delta": {"content": word}}]})
        + b"\n\n"
    )


EXACT = ", non_streams: exact"


def test_a_non_stream_goes_upstream_as_a_stream_and_only_its_json_comes_back() -> None:
    async def run() -> None:
        proc, resp = await admitted(limiter(), EXACT)
        sent = orjson.loads(resp.request_body.response.body_mutation.body)
        assert sent["stream"] is True
        assert sent["stream_options"] == {"include_usage": True}
        [h] = await proc.handle(
            pb.ProcessingRequest(
                response_headers=headers({":status": "200", "content-type": "text/event-stream"})
            )
        )
        assert h.mode_override.response_body_mode == 4  # FULL_DUPLEX_STREAMED
        set_headers = {
            o.header.key: o.header.raw_value
            for o in h.response_headers.response.header_mutation.set_headers
        }
        assert set_headers["content-type"] == b"application/json"
        bodies: list[Any] = []
        for w in (" one", " two", " three"):
            bodies += await proc.handle(
                pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk(w)))
            )
        # nothing goes back while the upstream generates: no reply to Envoy per chunk
        assert bodies == []
        usage = {"prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11}
        tail = b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
        tail += (
            b'data: {"id":"c","choices":[],"usage":'
            + orjson.dumps(usage)
            + b"}\n\ndata: [DONE]\n\n"
        )
        last = await proc.handle(
            pb.ProcessingRequest(response_body=pb.HttpBody(body=tail, end_of_stream=True))
        )
        streamed = [r.response_body.response.body_mutation.streamed_response for r in last]
        assert streamed[-1].end_of_stream
        got = orjson.loads(b"".join(s.body for s in streamed))
        assert got["choices"][0]["message"]["content"] == " one two three"
        assert got["choices"][0]["finish_reason"] == "stop" and got["usage"] == usage
        await asyncio.sleep(0.05)
        assert proc.s.ending is Ending.COMPLETED
        assert proc.s.output_decided == 3

    asyncio.run(run())


def test_an_abandoned_non_stream_settles_on_what_passed() -> None:
    async def run() -> None:
        proc, _ = await admitted(limiter(), EXACT)
        await proc.handle(
            pb.ProcessingRequest(
                response_headers=headers({":status": "200", "content-type": "text/event-stream"})
            )
        )
        words = [" alpha", " beta", " gamma", " delta", " epsilon"]
        for w in words:
            await proc.handle(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk(w))))
        proc.close(Closed.CANCELLED)  # the client left before the end
        await asyncio.sleep(0.05)
        assert proc.s.ending is Ending.CLIENT_DISCONNECTED
        assert proc.s.output_decided == 5  # what passed, not a rate times the time

    asyncio.run(run())


def test_the_json_path_is_the_default_and_forwards_the_request_as_sent() -> None:
    async def run() -> None:
        proc, resp = await admitted(limiter())
        mutated = resp.request_body.response.body_mutation.body
        assert not mutated or "stream" not in orjson.loads(mutated)
        [h] = await proc.handle(
            pb.ProcessingRequest(
                response_headers=headers({":status": "200", "content-type": "application/json"})
            )
        )
        assert h.mode_override.response_body_mode == 1  # STREAMED: the JSON body is read

    asyncio.run(run())


def test_an_upstream_that_answers_json_to_a_stream_is_read_as_json() -> None:
    """An upstream that cannot stream answers the exact path's request with JSON: it is read
    for its usage as any JSON response (the JSON path's figures)."""

    async def run() -> None:
        proc, _ = await admitted(limiter(), EXACT)
        [h] = await proc.handle(
            pb.ProcessingRequest(
                response_headers=headers({":status": "200", "content-type": "application/json"})
            )
        )
        assert h.mode_override.response_body_mode == 1  # STREAMED: the JSON body is read
        usage = {"prompt_tokens": 8, "completion_tokens": 5, "total_tokens": 13}
        body = orjson.dumps({"id": "c", "object": "chat.completion", "choices": [], "usage": usage})
        await proc.handle(
            pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=True))
        )
        await asyncio.sleep(0.05)
        assert proc.s.ending is Ending.COMPLETED and proc.s.output_decided == 5

    asyncio.run(run())


def test_an_exact_stream_interval_asks_the_engine_for_that_many_tokens_per_chunk() -> None:
    """``exact_stream_interval``: the non-stream goes upstream with vLLM's ``stream_interval``
    (one chunk, so one ext_proc message, per that many tokens); a chunk of several tokens is
    rebuilt and, abandoned, counted as one of one token is."""

    async def run() -> None:
        proc, resp = await admitted(limiter(), EXACT + ", exact_stream_interval: 8")
        sent = orjson.loads(resp.request_body.response.body_mutation.body)
        assert sent["stream"] is True and sent["stream_interval"] == 8
        await proc.handle(
            pb.ProcessingRequest(
                response_headers=headers({":status": "200", "content-type": "text/event-stream"})
            )
        )
        for w in (" one", " two three four five six seven eight nine"):
            await proc.handle(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk(w))))
        proc.close(Closed.CANCELLED)
        await asyncio.sleep(0.05)
        assert proc.s.ending is Ending.CLIENT_DISCONNECTED
        assert proc.s.output_decided == 9  # every token of both chunks

    asyncio.run(run())


def test_a_client_stream_is_never_asked_for_a_stream_interval() -> None:
    """The interval is the exact path's: a client's own stream keeps one chunk per token."""

    async def run() -> None:
        cfg = load_config_text(RULES % (EXACT + ", exact_stream_interval: 8"))
        lim = limiter()
        gw = Gateway(config=cfg, limiter=lim, clock=lim.inner.clock, metrics=Metrics())
        proc = RequestProcessor(gw)
        await proc.handle(
            pb.ProcessingRequest(
                request_headers=headers(
                    {
                        ":path": "/v1/chat/completions",
                        ":method": "POST",
                        "authorization": "Bearer sk-t",
                    }
                )
            )
        )
        body = orjson.dumps(
            {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        )
        [resp] = await proc.handle(
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
        )
        mutated = resp.request_body.response.body_mutation.body
        assert not mutated or "stream_interval" not in orjson.loads(mutated)

    asyncio.run(run())


def test_an_exact_stream_interval_needs_the_exact_path() -> None:
    with pytest.raises(ConfigError, match="exact_stream_interval"):
        load_config_text(RULES % ", exact_stream_interval: 8")
    with pytest.raises(ConfigError):  # more than 16 unsent tokens could go unbilled
        load_config_text(RULES % (EXACT + ", exact_stream_interval: 17"))


@pytest.mark.parametrize(
    ("extra", "sent"), [(EXACT, None), (EXACT + ", exact_stream_interval: 4", 4)]
)
def test_a_clients_stream_interval_never_reaches_the_exact_paths_stream(
    extra: str, sent: int | None
) -> None:
    """vLLM ignores ``stream_interval`` on a non-stream, but the exact path makes it a stream:
    a client's 100,000 would leave every abandoned token but the first unseen (billed as not
    generated).  Upstream, the gateway's interval or none."""

    async def run() -> None:
        cfg = load_config_text(RULES % extra)
        lim = limiter()
        gw = Gateway(config=cfg, limiter=lim, clock=lim.inner.clock, metrics=Metrics())
        proc = RequestProcessor(gw)
        await proc.handle(
            pb.ProcessingRequest(
                request_headers=headers(
                    {
                        ":path": "/v1/chat/completions",
                        ":method": "POST",
                        "authorization": "Bearer sk-t",
                    }
                )
            )
        )
        body = orjson.dumps(
            {
                "model": "m",
                "stream_interval": 100_000,
                "messages": [{"role": "user", "content": "hi"}],
            }
        )
        [resp] = await proc.handle(
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
        )
        upstream = orjson.loads(resp.request_body.response.body_mutation.body)
        assert upstream["stream"] is True
        assert upstream.get("stream_interval") == sent

    asyncio.run(run())


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
payloads = st.one_of(
    st.dictionaries(st.text(max_size=6), json_values, max_size=4).map(orjson.dumps),
    st.sampled_from(
        [b"[DONE]", b"", b"{", b"}", b'{"a":1},{"b":2}', b'{"a":[1', b"2]}", b"[1]", b"7"]
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(payloads, max_size=12),
    odd=st.sampled_from([b"", b": comment\n\n", b"event: x\n", b"\r\n", b"data:{}\n\n"]),
    at=st.integers(min_value=0, max_value=12),
    ended=st.booleans(),
)
def test_the_one_call_parse_reads_what_the_decoder_reads(
    events: list[bytes], odd: bytes, at: int, ended: bool
) -> None:
    """The usual stream's events parsed in one call are the SSE decoder's, payload by
    payload, whatever the payloads (malformed ones skipped, two objects in one event not
    read as two) and whatever else the stream holds (comments, names, CRs, an unended
    event)."""
    blocks = [b"data: " + e + b"\n\n" for e in events]
    blocks.insert(min(at, len(blocks)), odd)
    raw = b"".join(blocks)
    if not ended and raw.endswith(b"\n\n"):
        raw = raw[:-1]
    assert stream_events(raw) == decoded_events(raw)
