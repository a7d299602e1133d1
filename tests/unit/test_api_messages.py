"""The Anthropic Messages format (extproc.core.apis.messages): parsing, counting, rewriting,
the stateful stream reader, usage, Anthropic-shaped errors and headers, the cut event."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.clock import FakeClock
from extproc.core.apis.base import RequestLimits
from extproc.core.apis.messages import MESSAGES, MessagesFormat, MessagesReader
from extproc.core.chunks import MalformedChunk, Usage
from extproc.core.sse import SSEDecoder
from extproc.core.tokens import PromptShapeError
from extproc.errors import (
    AuthenticationError,
    BadRequest,
    GatewayError,
    InternalError,
    LimiterUnavailable,
    PermissionDenied,
    QuotaExceeded,
    RateLimitHeaders,
    RequestTooLarge,
    StreamCut,
    UnknownModel,
)
from tests.apis_support import CL100K, cl100k, read_stream, sse_bytes

pytestmark = pytest.mark.unit

LIMITS = RequestLimits(max_tokens_ceiling=8192, max_n=8)
SPEC = CL100K
USER = [{"role": "user", "content": "Hello"}]


def parse(body: dict[str, Any]) -> Any:
    return MESSAGES.parse(orjson.dumps(body), LIMITS)


def count(body: dict[str, Any]) -> int:
    return MESSAGES.count_input(parse(body), cl100k(), SPEC)


def c(text: str) -> int:
    return cl100k().count(text)


def body_with(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 100, "messages": USER, **extra}


# --------------------------------------------------------------------------- parsing


def test_parse_minimal() -> None:
    req = parse(body_with())
    assert (req.api, req.model, req.stream, req.sequences) == ("messages", "m", False, 1)
    assert req.declared_max_output == 100
    assert req.budget_fields == ("max_tokens",)
    assert parse(body_with(stream=True)).stream is True


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": USER}, "max_tokens"),
        ({"model": "m", "messages": USER, "max_tokens": None}, "max_tokens"),
        (body_with(max_tokens=0), "max_tokens"),
        (body_with(max_tokens=8193), "max_tokens"),
        (body_with(max_tokens=2.5), "max_tokens"),
        (body_with(max_tokens="64"), "max_tokens"),
        (body_with(max_tokens=False), "max_tokens"),
        ({"max_tokens": 5, "messages": USER}, "model"),
        ({"model": "m", "max_tokens": 5}, "messages"),
        (body_with(messages=[]), "messages"),
        (body_with(messages="hi"), "messages"),
        (body_with(messages=["hi"]), "messages"),
        (body_with(system=5), "system"),
        (body_with(tools={"name": "x"}), "tools"),
        (body_with(stream="true"), "stream"),
    ],
)
def test_parse_rejects(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse(body)
    assert info.value.status == 400
    assert info.value.param == param


def test_missing_max_tokens_renders_in_anthropic_shape() -> None:
    with pytest.raises(BadRequest) as info:
        parse({"model": "m", "messages": USER})
    assert orjson.loads(MESSAGES.error_body(info.value)) == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "'max_tokens' is required and must be an integer",
        },
    }


def test_bad_json_is_a_400() -> None:
    for raw in (b"", b"{", b'"x"'):
        with pytest.raises(BadRequest):
            MESSAGES.parse(raw, LIMITS)


def test_integral_float_max_tokens() -> None:
    req = parse(body_with(max_tokens=64.0))
    assert req.declared_max_output == 64 and isinstance(req.declared_max_output, int)
    out = MESSAGES.rewrite(req, budget=None, force_usage=False, model=None)
    assert out is not None and b'"max_tokens":64' in out


# --------------------------------------------------------------------------- counting


def test_count_string_messages_and_system() -> None:
    body = body_with(
        system="You are a pirate.",
        messages=[
            {"role": "user", "content": "Where is the treasure?"},
            {"role": "assistant", "content": "Arr, buried."},
        ],
    )
    expected = (
        3
        + 3
        + c("You are a pirate.")
        + 3
        + c("user")
        + c("Where is the treasure?")
        + 3
        + c("assistant")
        + c("Arr, buried.")
    )
    assert count(body) == expected


def test_count_system_blocks() -> None:
    system = [
        {"type": "text", "text": "Rule one.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Rule two."},
    ]
    base = count(body_with())
    assert count(body_with(system=system)) - base == 3 + c("Rule one.") + c("Rule two.")


def test_count_content_blocks() -> None:
    tool_input = {"city": "Oslo", "unit": "celsius"}
    blocks: list[dict[str, Any]] = [
        {"type": "text", "text": "Look at this."},
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": "A" * 5000},
        },
        {"type": "thinking", "thinking": "Hmm, a map.", "signature": "sig"},
        {"type": "redacted_thinking", "data": "ZXhhbXBsZQ=="},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": tool_input},
    ]
    results: list[dict[str, Any]] = [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "4 degrees"},
        {
            "type": "tool_result",
            "tool_use_id": "toolu_2",
            "content": [{"type": "text", "text": "cloudy"}, {"type": "image", "source": {}}],
        },
    ]
    body = body_with(
        messages=[
            {"role": "user", "content": blocks[:2]},
            {"role": "assistant", "content": blocks[2:]},
            {"role": "user", "content": results},
        ]
    )
    expected = (
        3
        + (3 + c("user") + c("Look at this.") + 765)
        + (
            3
            + c("assistant")
            + c("Hmm, a map.")
            + c("ZXhhbXBsZQ==")
            + c("get_weather")
            + c(orjson.dumps(tool_input).decode())
        )
        + (3 + c("user") + c("4 degrees") + c("cloudy") + 765)
    )
    assert count(body) == expected


def test_count_documents() -> None:
    text_doc = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": "The grass is green."},
        "title": "Facts",
        "context": "From a primer",
    }
    content_doc = {
        "type": "document",
        "source": {"type": "content", "content": [{"type": "text", "text": "Sky is blue."}]},
    }
    pdf_doc = {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"},
    }
    base = count(body_with(messages=[{"role": "user", "content": []}]))

    def with_block(block: dict[str, Any]) -> int:
        return count(body_with(messages=[{"role": "user", "content": [block]}])) - base

    assert with_block(text_doc) == c("Facts") + c("From a primer") + c("The grass is green.")
    assert with_block(content_doc) == c("Sky is blue.")
    assert with_block(pdf_doc) == 1000


def test_count_unknown_block_and_tools_as_json() -> None:
    block = {"type": "search_result", "source": "https://x", "title": "t", "content": []}
    base = count(body_with(messages=[{"role": "user", "content": []}]))
    got = count(body_with(messages=[{"role": "user", "content": [block]}]))
    assert got - base == c(orjson.dumps(block).decode())
    tools = [
        {
            "name": "get_weather",
            "description": "Weather",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    assert count(body_with(tools=tools)) - count(body_with()) == c(orjson.dumps(tools).decode())


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": 1, "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": ["x"]}], "messages[0].content[0]"),
        ([{"role": "user", "content": [{"text": "x"}]}], "messages[0].content[0].type"),
        (
            [{"role": "user", "content": [{"type": "text", "text": 3}]}],
            "messages[0].content[0].text",
        ),
        (
            [{"role": "user", "content": [{"type": "tool_result", "content": 9}]}],
            "messages[0].content[0].content",
        ),
        (
            [{"role": "user", "content": [{"type": "document", "source": {"type": "text"}}]}],
            "messages[0].content[0].source.data",
        ),
    ],
)
def test_count_shape_errors_name_the_field(messages: list[Any], field: str) -> None:
    req = parse(body_with(messages=messages))
    with pytest.raises(PromptShapeError, match=rf"^{re.escape(field)} "):
        MESSAGES.count_input(req, cl100k(), SPEC)


def test_system_blocks_must_be_objects() -> None:
    with pytest.raises(PromptShapeError, match=r"^system\[0\] "):
        count(body_with(system=["plain"]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=120), min_size=1, max_size=5))
def test_count_property(texts: list[str]) -> None:
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)
    ]
    expected = 3 + sum(
        3 + c("user" if i % 2 == 0 else "assistant") + c(t) for i, t in enumerate(texts)
    )
    assert count(body_with(messages=messages)) == expected


# --------------------------------------------------------------------------- rewriting


def test_rewrite_lowers_max_tokens_and_replaces_the_model() -> None:
    req = parse(body_with(model="alias", max_tokens=4000))
    out = MESSAGES.rewrite(req, budget=1000, force_usage=True, model="meta-llama/Llama-3.1-8B")
    assert out is not None
    body = orjson.loads(out)
    assert body["max_tokens"] == 1000 and body["model"] == "meta-llama/Llama-3.1-8B"
    assert "stream_options" not in body
    req = parse(body_with(max_tokens=500))
    assert MESSAGES.rewrite(req, budget=1000, force_usage=True, model="m") is None


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8192), st.integers(1, 8192))
def test_rewrite_budget_property(declared: int, budget: int) -> None:
    body = body_with(max_tokens=declared)
    out = MESSAGES.rewrite(parse(body), budget=budget, force_usage=False, model=None)
    sent = (orjson.loads(out) if out is not None else body)["max_tokens"]
    assert sent == min(declared, budget) and isinstance(sent, int)
    assert (out is None) == (declared <= budget)


# --------------------------------------------------------------------------- streams


@pytest.mark.parametrize("chunk_size", [1, 13, 4096])
def test_reader_text_stream(chunk_size: int) -> None:
    t = read_stream(MESSAGES.stream_reader(), sse_bytes("messages_text.sse"), chunk_size=chunk_size)
    assert t.texts == {0: "Hello! The capital of France is Paris."}
    assert t.pieces == 9
    assert t.usage == Usage(25, 9, 34, cached_input_tokens=0)
    assert t.finish == [(0, "end_turn")]
    assert t.done_at == len(t.chunks) - 1
    assert t.errors == []


def test_reader_thinking_text_and_tool_use_are_one_sequence() -> None:
    t = read_stream(MESSAGES.stream_reader(), sse_bytes("messages_thinking_tool.sse"))
    assert t.texts == {0: 'Need the weather tool for Oslo.Let me check that.{"city": "Oslo"}'}
    # prompt = input + cache reads + cache writes; cached = cache reads
    assert t.usage == Usage(434, 27, 461, cached_input_tokens=400)
    assert t.finish == [(0, "tool_use")]
    assert t.done_at == len(t.chunks) - 1
    # the signature is not model text
    assert all("EqQB" not in text for ch in t.chunks for _, text in ch.texts)


def test_reader_error_event() -> None:
    t = read_stream(MESSAGES.stream_reader(), sse_bytes("messages_error.sse"))
    assert t.texts == {0: "Sure, here is"}
    assert t.errors == [{"type": "overloaded_error", "message": "Overloaded"}]
    assert t.usage is None and t.done_at is None


def test_reader_keeps_input_figures_per_stream() -> None:
    a, b = MessagesReader(), MessagesReader()
    a.read("message_start", '{"type":"message_start","message":{"usage":{"input_tokens":50}}}')
    # without message_start, a bare output count is no usage
    assert b.read(None, '{"type":"message_delta","usage":{"output_tokens":3}}').usage is None
    assert a.read(None, '{"type":"message_delta","usage":{"output_tokens":3}}').usage == Usage(
        50, 3, 53
    )
    # a message_delta that restates input figures (newer servers) updates them
    ch = a.read(
        None,
        '{"type":"message_delta","usage":{"input_tokens":50,"cache_read_input_tokens":10,'
        '"output_tokens":8}}',
    )
    assert ch.usage == Usage(60, 8, 68, cached_input_tokens=10)


def test_reader_edge_cases() -> None:
    r = MessagesReader()
    with pytest.raises(MalformedChunk):
        r.read("content_block_delta", "not json")
    with pytest.raises(MalformedChunk):
        r.read(None, "3")
    assert r.read("ping", '{"type": "ping"}') == r.read(None, '{"type": "content_block_stop"}')
    # the event name stands in for a missing type
    ch = r.read("content_block_delta", '{"delta": {"type": "text_delta", "text": "x"}}')
    assert ch.texts == [(0, "x")]
    assert (
        r.read(
            None, '{"type":"content_block_delta","index":3,"delta":{"type":"citations_delta"}}'
        ).texts
        == []
    )
    # text a server puts straight into content_block_start is output too
    ch = r.read(
        None, '{"type":"content_block_start","index":0,"content_block":{"type":"text","text":"Hi"}}'
    )
    assert ch.texts == [(0, "Hi")]
    assert r.read(None, '{"type": "message_stop"}').done


def test_json_usage() -> None:
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "Hi"}],
        "stop_reason": "end_turn",
        "usage": {
            "input_tokens": 12,
            "cache_creation_input_tokens": 30,
            "cache_read_input_tokens": 200,
            "output_tokens": 7,
        },
    }
    assert MESSAGES.json_usage(orjson.dumps(message)) == Usage(242, 7, 249, cached_input_tokens=200)
    minimal = {"usage": {"input_tokens": 3, "output_tokens": 4, "cache_read_input_tokens": None}}
    assert MESSAGES.json_usage(orjson.dumps(minimal)) == Usage(3, 4, 7)
    for bad in (b"", b"x", b"[]", b'{"usage": {"input_tokens": 3}}', b'{"usage": 5}'):
        assert MESSAGES.json_usage(bad) is None


# --------------------------------------------------------------------------- errors and cut


@pytest.mark.parametrize(
    ("err", "etype"),
    [
        (BadRequest("bad"), "invalid_request_error"),
        (AuthenticationError("no key"), "authentication_error"),
        (PermissionDenied("no tenant"), "permission_error"),
        (UnknownModel("nope"), "not_found_error"),
        (UnknownModel("nope", status=400), "invalid_request_error"),
        (RequestTooLarge("big"), "request_too_large"),
        (InternalError("bug"), "api_error"),
        (LimiterUnavailable("down"), "overloaded_error"),
        (StreamCut("cut", status=502, error_type="server_error", code="x"), "api_error"),
    ],
)
def test_error_body_types(err: GatewayError, etype: str) -> None:
    assert orjson.loads(MESSAGES.error_body(err)) == {
        "type": "error",
        "error": {"type": etype, "message": err.message},
    }


HEADERS = RateLimitHeaders(
    limit_requests=50,
    remaining_requests=0,
    reset_requests_s=12.5,
    limit_tokens=40_000,
    remaining_tokens=1_500,
    reset_tokens_s=0.2,
)
QUOTA = QuotaExceeded("Too many requests.", metric="rpm", retry_after_s=12.5, headers=HEADERS)
NOW_MS = 1_714_564_800_000  # 2024-05-01T12:00:00Z


def test_quota_body_and_headers() -> None:
    assert orjson.loads(MESSAGES.error_body(QUOTA)) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "Too many requests."},
    }
    h = dict(MESSAGES.error_headers(QUOTA, now_ms=NOW_MS))
    assert h == {
        "content-type": "application/json",
        "retry-after": "13",
        "anthropic-ratelimit-requests-limit": "50",
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": "2024-05-01T12:00:13Z",
        "anthropic-ratelimit-tokens-limit": "40000",
        "anthropic-ratelimit-tokens-remaining": "1500",
        "anthropic-ratelimit-tokens-reset": "2024-05-01T12:00:01Z",
        "anthropic-ratelimit-input-tokens-limit": "40000",
        "anthropic-ratelimit-input-tokens-remaining": "1500",
        "anthropic-ratelimit-input-tokens-reset": "2024-05-01T12:00:01Z",
        "anthropic-ratelimit-output-tokens-limit": "40000",
        "anthropic-ratelimit-output-tokens-remaining": "1500",
        "anthropic-ratelimit-output-tokens-reset": "2024-05-01T12:00:01Z",
    }
    assert not any(k.startswith("x-ratelimit") for k in h)


def test_reset_headers_need_a_clock() -> None:
    h = dict(MESSAGES.error_headers(QUOTA))
    assert "anthropic-ratelimit-requests-limit" in h
    assert not any(k.endswith("-reset") for k in h)
    clocked = MESSAGES.with_clock(FakeClock(NOW_MS))
    assert isinstance(clocked, MessagesFormat)
    assert dict(clocked.error_headers(QUOTA)) == dict(MESSAGES.error_headers(QUOTA, now_ms=NOW_MS))
    # a per-call now wins over the clock
    later = dict(clocked.error_headers(QUOTA, now_ms=NOW_MS + 60_000))
    assert later["anthropic-ratelimit-requests-reset"] == "2024-05-01T12:01:13Z"


@settings(max_examples=80, deadline=None)
@given(
    st.floats(0.001, 86_400, allow_nan=False),
    st.integers(1_600_000_000_000, 1_900_000_000_000),
)
def test_reset_is_rfc3339_and_never_before_retry_after(reset_s: float, now_ms: int) -> None:
    headers = RateLimitHeaders(limit_tokens=10, remaining_tokens=0, reset_tokens_s=reset_s)
    err = QuotaExceeded("x", metric="tpm", retry_after_s=reset_s, headers=headers)
    h = dict(MESSAGES.error_headers(err, now_ms=now_ms))
    stamp = h["anthropic-ratelimit-tokens-reset"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", stamp)
    at = dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()
    assert at >= now_ms / 1000 + reset_s
    assert at < now_ms / 1000 + reset_s + 1
    assert int(h["retry-after"]) >= reset_s


def test_503_has_retry_after_and_other_errors_none() -> None:
    assert dict(MESSAGES.error_headers(LimiterUnavailable("down")))["retry-after"] == "1"
    assert MESSAGES.error_headers(BadRequest("x")) == [("content-type", "application/json")]


def test_cut_event() -> None:
    err = StreamCut("Rate limit reached for tokens.", status=429, error_type="tokens", code="tpm")
    raw = MESSAGES.cut_events(err)
    events = SSEDecoder().feed(raw)
    assert len(events) == 1 and events[0].raw == raw
    assert events[0].event == "error"
    assert events[0].data is not None
    data = orjson.loads(events[0].data)
    assert data == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "Rate limit reached for tokens."},
    }
    assert b"[DONE]" not in raw and b"message_stop" not in raw
    assert MessagesReader().read("error", events[0].data).error == data["error"]
    down = StreamCut("restarting", status=503, error_type="server_error", code="server_shutdown")
    assert b'"overloaded_error"' in MESSAGES.cut_events(down)
