"""The Responses API format (extproc.core.apis.responses): parsing, counting, rewriting, the
stream reader over recorded-style streams, usage, errors and the cut event."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.apis.base import RequestLimits
from extproc.core.apis.errors import error_body, error_headers
from extproc.core.apis.responses import RESPONSES, ResponsesReader
from extproc.core.chunks import MalformedChunk, Usage
from extproc.core.sse import SSEDecoder
from extproc.core.tokens import PromptShapeError
from extproc.errors import (
    BadRequest,
    LimiterUnavailable,
    QuotaExceeded,
    RateLimitHeaders,
    StreamCut,
)
from tests.apis_support import CL100K, cl100k, read_stream, sse_bytes

pytestmark = pytest.mark.unit

LIMITS = RequestLimits(max_tokens_ceiling=4096, max_n=8)
SPEC = CL100K  # tokens_per_message 3, reply_priming 3, image 765, file 1000, audio 1000


def parse(body: dict[str, Any]) -> Any:
    return RESPONSES.parse(orjson.dumps(body), LIMITS)


def count(body: dict[str, Any]) -> int:
    return RESPONSES.count_input(parse(body), cl100k(), SPEC)


def c(text: str) -> int:
    return cl100k().count(text)


# --------------------------------------------------------------------------- parsing


def test_parse_minimal() -> None:
    req = parse({"model": "m", "input": "hi"})
    assert (req.api, req.model, req.stream, req.sequences) == ("responses", "m", False, 1)
    assert req.declared_max_output is None
    assert req.budget_fields == ("max_output_tokens",)
    assert req.client_include_usage is True
    assert req.notes == {}


def test_parse_stream_and_budget() -> None:
    req = parse({"model": "m", "input": "hi", "stream": True, "max_output_tokens": 300})
    assert req.stream is True
    assert req.declared_max_output == 300


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"", None),
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"input": "x"}', "model"),
        (b'{"model": "", "input": "x"}', "model"),
        (b'{"model": "m", "input": 5}', "input"),
        (b'{"model": "m", "input": {"role": "user"}}', "input"),
        (b'{"model": "m", "input": [1]}', "input"),
        (b'{"model": "m", "input": "x", "instructions": ["a"]}', "instructions"),
        (b'{"model": "m", "input": "x", "tools": {"type": "function"}}', "tools"),
        (b'{"model": "m", "input": "x", "tools": ["f"]}', "tools"),
        (b'{"model": "m", "input": "x", "stream": "yes"}', "stream"),
        (b'{"model": "m", "input": "x", "n": 2}', "n"),
        (b'{"model": "m", "input": "x", "n": true}', "n"),
        (b'{"model": "m", "input": "x", "max_output_tokens": 0}', "max_output_tokens"),
        (b'{"model": "m", "input": "x", "max_output_tokens": -3}', "max_output_tokens"),
        (b'{"model": "m", "input": "x", "max_output_tokens": 4097}', "max_output_tokens"),
        (b'{"model": "m", "input": "x", "max_output_tokens": 1.5}', "max_output_tokens"),
        (b'{"model": "m", "input": "x", "max_output_tokens": "10"}', "max_output_tokens"),
        (b'{"model": "m", "input": "x", "max_output_tokens": true}', "max_output_tokens"),
        (b'{"model": "m", "previous_response_id": 7}', "previous_response_id"),
    ],
)
def test_parse_rejects(raw: bytes, param: str | None) -> None:
    with pytest.raises(BadRequest) as info:
        RESPONSES.parse(raw, LIMITS)
    assert info.value.status == 400
    assert info.value.param == param


def test_n_of_one_is_accepted() -> None:
    assert parse({"model": "m", "input": "x", "n": 1}).sequences == 1


def test_integral_float_budget_is_an_int_and_forwarded() -> None:
    req = parse({"model": "m", "input": "x", "max_output_tokens": 10.0})
    assert req.declared_max_output == 10
    assert isinstance(req.declared_max_output, int)
    out = RESPONSES.rewrite(req, budget=None, force_usage=False, model=None)
    assert out is not None
    sent = orjson.loads(out)["max_output_tokens"]
    assert sent == 10 and isinstance(sent, int)
    assert b"10.0" not in out


def test_previous_response_id_is_noted() -> None:
    req = parse({"model": "m", "input": "and then?", "previous_response_id": "resp_abc"})
    assert req.notes["previous_response_id"] == "resp_abc"
    assert req.notes["unseen_input"] == ("previous_response_id",)
    req = parse({"model": "m", "conversation": "conv_1", "prompt": {"id": "pmpt_1"}})
    assert req.notes["unseen_input"] == ("conversation", "prompt")
    assert "previous_response_id" not in req.notes


# --------------------------------------------------------------------------- counting


def test_count_string_input_and_instructions() -> None:
    text = "Explain the tides in two sentences."
    assert count({"model": "m", "input": text}) == 3 + 3 + c(text)
    instr = "You are terse."
    assert count({"model": "m", "input": text, "instructions": instr}) == 3 + 3 + c(text) + 3 + c(
        instr
    )


def test_count_no_input() -> None:
    assert count({"model": "m", "previous_response_id": "resp_1"}) == 3


def test_count_message_items_and_parts() -> None:
    body = {
        "model": "m",
        "input": [
            {"role": "system", "content": "Be brief."},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is in this picture?"},
                    {"type": "input_image", "image_url": "https://example.com/a-long-url.png"},
                    {"type": "input_file", "file_id": "file-123"},
                    {"type": "input_file", "filename": "n.txt", "text": "inline notes"},
                    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": "A cat."},
                    {"type": "refusal", "refusal": "No."},
                ],
            },
        ],
    }
    expected = (
        3  # reply priming
        + 3
        + c("system")
        + c("Be brief.")
        + 3
        + c("user")
        + c("What is in this picture?")
        + 765  # flat image cost, whatever the URL
        + 1000  # a file by id
        + c("inline notes")
        + 1000  # audio
        + 3
        + c("assistant")
        + c("A cat.")
        + c("No.")
    )
    assert count(body) == expected


def test_image_cost_does_not_depend_on_the_url() -> None:
    def body(url: str) -> dict[str, Any]:
        part = {"type": "input_image", "image_url": url, "detail": "high"}
        return {"model": "m", "input": [{"role": "user", "content": [part]}]}

    assert count(body("https://x.y/a.png")) == count(body("data:image/png;base64," + "A" * 9000))


def test_count_function_call_items_reasoning_and_unknown() -> None:
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
    }
    output = {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 4}'}
    reasoning = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": "Look up weather."}],
        "content": [{"type": "reasoning_text", "text": "Use the tool."}],
        "encrypted_content": "gAAAAB",
    }
    ref = {"type": "item_reference", "id": "msg_123"}
    body = {"model": "m", "input": [call, output, reasoning, ref]}
    expected = (
        3
        + 3
        + c("get_weather")
        + c('{"city": "Oslo"}')
        + 3
        + c('{"temp": 4}')
        + 3
        + c("Look up weather.")
        + c("Use the tool.")
        + c("gAAAAB")
        + 3
        + c(orjson.dumps(ref).decode())
    )
    assert count(body) == expected


def test_count_function_call_output_as_parts() -> None:
    output = {
        "type": "function_call_output",
        "call_id": "c",
        "output": [
            {"type": "input_text", "text": "sunny"},
            {"type": "input_image", "file_id": "f"},
        ],
    }
    assert count({"model": "m", "input": [output]}) == 3 + 3 + c("sunny") + 765


def test_count_tools_and_schema_as_json() -> None:
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    fmt = {
        "type": "json_schema",
        "name": "answer",
        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
    }
    base = count({"model": "m", "input": "hi"})
    with_tools = count({"model": "m", "input": "hi", "tools": tools})
    assert with_tools - base == c(orjson.dumps(tools).decode())
    with_fmt = count({"model": "m", "input": "hi", "text": {"format": fmt}})
    assert with_fmt - base == c(orjson.dumps(fmt).decode())
    plain = count({"model": "m", "input": "hi", "text": {"format": {"type": "text"}}})
    assert plain == base


@pytest.mark.parametrize(
    ("items", "field"),
    [
        ([{"role": "user", "content": 5}], "input[0].content"),
        ([{"role": 3, "content": "x"}], "input[0].role"),
        ([{"role": "user", "content": [7]}], "input[0].content[0]"),
        ([{"role": "user", "content": [{"text": "no type"}]}], "input[0].content[0].type"),
        (
            [{"role": "user", "content": [{"type": "input_text", "text": 1}]}],
            "input[0].content[0].text",
        ),
        ([{"type": "function_call", "name": 5}], "input[0].name"),
        ([{"type": 4}], "input[0].type"),
    ],
)
def test_count_shape_errors_name_the_field(items: list[Any], field: str) -> None:
    req = parse({"model": "m", "input": items})
    with pytest.raises(PromptShapeError, match=rf"^{re.escape(field)} "):
        RESPONSES.count_input(req, cl100k(), SPEC)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=300), st.text(max_size=80))
def test_count_string_input_property(text: str, instructions: str) -> None:
    body = {"model": "m", "input": text, "instructions": instructions}
    assert count(body) == 3 + 3 + c(text) + 3 + c(instructions)


# --------------------------------------------------------------------------- rewriting


def test_rewrite_adds_budget_when_absent() -> None:
    req = parse({"model": "alias", "input": "x"})
    out = RESPONSES.rewrite(req, budget=512, force_usage=True, model=None)
    assert out is not None
    assert orjson.loads(out)["max_output_tokens"] == 512


def test_rewrite_lowers_a_larger_budget_and_keeps_a_smaller_one() -> None:
    req = parse({"model": "m", "input": "x", "max_output_tokens": 2000})
    out = RESPONSES.rewrite(req, budget=700, force_usage=False, model=None)
    assert out is not None and orjson.loads(out)["max_output_tokens"] == 700
    req = parse({"model": "m", "input": "x", "max_output_tokens": 100})
    assert RESPONSES.rewrite(req, budget=700, force_usage=True, model=None) is None


def test_rewrite_replaces_the_model_alias() -> None:
    req = parse({"model": "small", "input": "x", "max_output_tokens": 5})
    out = RESPONSES.rewrite(req, budget=10, force_usage=False, model="Qwen/Qwen3-8B")
    assert out is not None
    body = orjson.loads(out)
    assert body["model"] == "Qwen/Qwen3-8B" and body["max_output_tokens"] == 5
    assert "stream_options" not in body
    req = parse({"model": "Qwen/Qwen3-8B", "input": "x", "max_output_tokens": 5})
    assert RESPONSES.rewrite(req, budget=10, force_usage=False, model="Qwen/Qwen3-8B") is None


@settings(max_examples=80, deadline=None)
@given(st.one_of(st.none(), st.integers(1, 4096)), st.integers(1, 4096))
def test_rewrite_budget_property(declared: int | None, budget: int) -> None:
    body: dict[str, Any] = {"model": "m", "input": "x"}
    if declared is not None:
        body["max_output_tokens"] = declared
    out = RESPONSES.rewrite(parse(body), budget=budget, force_usage=False, model=None)
    sent = (orjson.loads(out) if out is not None else body)["max_output_tokens"]
    assert sent == (budget if declared is None else min(declared, budget))
    assert isinstance(sent, int)


# --------------------------------------------------------------------------- streams


PIECES = [
    " rise",
    " and",
    " fall",
    " twice",
    " a",
    " day",
    ",",
    " pulled",
    " by",
    " the",
    " Moon",
    ".",
]
PIECES.insert(0, "Tides")
TEXT = "".join(PIECES)


@pytest.mark.parametrize("chunk_size", [1, 7, 97, 100_000])
def test_reader_text_stream(chunk_size: int) -> None:
    t = read_stream(
        RESPONSES.stream_reader(), sse_bytes("responses_text.sse"), chunk_size=chunk_size
    )
    assert t.texts == {0: TEXT}
    assert t.pieces == 13
    assert t.usage == Usage(41, 13, 54, cached_input_tokens=0, reasoning_tokens=0)
    assert t.done_at == len(t.chunks) - 1  # the terminal event is the last one
    assert t.finish == [(0, "completed")]
    assert t.errors == []
    # one piece per delta event; the *.done events repeat the text and add nothing
    assert [x for ch in t.chunks for _, x in ch.texts] == PIECES


def test_reader_reasoning_and_tool_call_per_output_index() -> None:
    t = read_stream(RESPONSES.stream_reader(), sse_bytes("responses_reasoning_tools.sse"))
    assert t.texts == {
        0: "The user wants the weather in Oslo.Call get_weather with city=Oslo.",
        1: '{"city": "Oslo", "unit": "celsius"}',
    }
    assert t.usage == Usage(212, 58, 270, cached_input_tokens=128, reasoning_tokens=31)
    assert t.done_at == len(t.chunks) - 1


def test_reader_incomplete() -> None:
    t = read_stream(RESPONSES.stream_reader(), sse_bytes("responses_incomplete.sse"))
    assert t.texts == {0: "Once upon a time there was"}
    assert t.usage == Usage(9, 6, 15)
    assert t.finish == [(0, "max_output_tokens")]
    assert t.done_at == len(t.chunks) - 1


def test_reader_refusal_then_error_event() -> None:
    reader = RESPONSES.stream_reader()
    t = read_stream(reader, sse_bytes("responses_refusal_error.sse"))
    assert t.texts == {0: "I can't help with that"}
    assert t.errors == [
        {"code": "server_error", "message": "The model backend stopped responding."}
    ]
    assert t.done_at is None and t.usage is None
    assert reader.last_sequence_number == 8


def test_reader_failed_response() -> None:
    t = read_stream(RESPONSES.stream_reader(), sse_bytes("responses_failed.sse"))
    assert t.texts == {0: "Partial answer"}
    assert t.usage is None
    assert t.done_at == len(t.chunks) - 1
    assert t.errors == [{"code": "server_error", "message": "The engine crashed while generating."}]
    assert t.finish == [(0, "failed")]


def test_reader_edge_cases() -> None:
    r = ResponsesReader()
    with pytest.raises(MalformedChunk):
        r.read("response.output_text.delta", "{oops")
    with pytest.raises(MalformedChunk):
        r.read(None, "[1]")
    # the event name stands in for a missing type; a missing output_index means 0
    ch = r.read("response.output_text.delta", '{"delta": "hey"}')
    assert ch.texts == [(0, "hey")]
    # empty, null or non-string deltas add nothing; unknown events are empty chunks
    assert r.read(None, '{"type": "response.output_text.delta", "delta": ""}').texts == []
    assert r.read(None, '{"type": "response.output_text.delta", "delta": null}').texts == []
    assert r.read(None, '{"type": "response.output_text.annotation.added"}').texts == []
    # a terminal event without a usable usage is still the end
    ch = r.read(None, '{"type": "response.completed", "response": {"usage": {"input_tokens": 1}}}')
    assert ch.done and ch.usage is None
    ch = r.read(None, '{"type": "error", "error": {"type": "server_error", "message": "m"}}')
    assert ch.error == {"type": "server_error", "message": "m"}


def test_json_usage() -> None:
    body = {
        "id": "resp_1",
        "object": "response",
        "status": "completed",
        "output": [],
        "usage": {
            "input_tokens": 328,
            "input_tokens_details": {"cached_tokens": 256},
            "output_tokens": 52,
            "output_tokens_details": {"reasoning_tokens": 12},
            "total_tokens": 380,
        },
    }
    assert RESPONSES.json_usage(orjson.dumps(body)) == Usage(
        328, 52, 380, cached_input_tokens=256, reasoning_tokens=12
    )
    no_total = {"usage": {"input_tokens": 3, "output_tokens": 4}}
    assert RESPONSES.json_usage(orjson.dumps(no_total)) == Usage(3, 4, 7)
    for bad in (b"", b"nope", b"[]", b'{"usage": null}', b'{"usage": {"input_tokens": "3"}}'):
        assert RESPONSES.json_usage(bad) is None


# --------------------------------------------------------------------------- errors and cut


QUOTA = QuotaExceeded(
    "Rate limit reached for tokens per minute.",
    metric="tpm",
    retry_after_s=41.2,
    headers=RateLimitHeaders(
        limit_requests=60,
        remaining_requests=10,
        reset_requests_s=3.0,
        limit_tokens=2000,
        remaining_tokens=0,
        reset_tokens_s=41.2,
    ),
)


def test_error_body_and_headers_are_openai_shaped() -> None:
    err = BadRequest("'max_output_tokens' must be at least 1, got 0", param="max_output_tokens")
    assert orjson.loads(RESPONSES.error_body(err)) == {
        "error": {
            "message": "'max_output_tokens' must be at least 1, got 0",
            "type": "invalid_request_error",
            "param": "max_output_tokens",
            "code": "invalid_request",
        }
    }
    assert RESPONSES.error_body(QUOTA) == error_body(QUOTA)
    headers = dict(RESPONSES.error_headers(QUOTA))
    assert headers == dict(error_headers(QUOTA))
    assert headers["retry-after"] == "42"
    assert headers["retry-after-ms"] == "41200"
    assert headers["x-ratelimit-remaining-tokens"] == "0"
    down = LimiterUnavailable("quota backend unavailable")
    assert dict(RESPONSES.error_headers(down))["retry-after"] == "1"
    assert orjson.loads(RESPONSES.error_body(down))["error"]["code"] == "quota_backend_unavailable"


def _cut(err: StreamCut, seq: int | None) -> tuple[str | None, dict[str, Any]]:
    raw = RESPONSES.cut_events(err, sequence_number=seq)
    events = SSEDecoder().feed(raw)
    assert len(events) == 1 and events[0].raw == raw
    assert events[0].data is not None
    return events[0].event, orjson.loads(events[0].data)


def test_cut_event_shape() -> None:
    err = StreamCut(
        "Rate limit reached; stopped.", status=429, error_type="tokens", code="tpm_limit_exceeded"
    )
    event, data = _cut(err, 41)
    assert event == "error"
    assert data == {
        "type": "error",
        "code": "tpm_limit_exceeded",
        "message": "Rate limit reached; stopped.",
        "param": None,
        "sequence_number": 42,
        "error": {
            "message": "Rate limit reached; stopped.",
            "type": "tokens",
            "param": None,
            "code": "tpm_limit_exceeded",
        },
    }
    assert b"[DONE]" not in RESPONSES.cut_events(err)
    assert _cut(err, None)[1]["sequence_number"] == 0
    # the reader reads the cut back as an error (what a proxy downstream would see)
    assert ResponsesReader().read(event, orjson.dumps(data).decode()).error == data["error"]
