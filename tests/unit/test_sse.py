"""Unit tests for the incremental SSE decoder (extproc.core.sse): spec examples and edge cases."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.sse import (
    DEFAULT_MAX_EVENT_BYTES,
    SSEDecodeError,
    SSEDecoder,
    SSEEvent,
    SSEEventTooLarge,
)

pytestmark = pytest.mark.unit


def decode_all(stream: bytes, cuts: list[int] | None = None) -> list[SSEEvent]:
    """Feed ``stream`` cut at ``cuts`` (default: whole), then flush."""
    decoder = SSEDecoder()
    events: list[SSEEvent] = []
    prev = 0
    for cut in [*sorted(set(cuts or [])), len(stream)]:
        events += decoder.feed(stream[prev:cut])
        prev = cut
    events += decoder.flush()
    assert decoder.pending_bytes == 0
    return events


def bytewise(stream: bytes) -> list[SSEEvent]:
    """Feed ``stream`` one byte at a time, then flush."""
    return decode_all(stream, list(range(1, len(stream))))


def test_single_data_event() -> None:
    """A ``data:`` line and a blank line give one event whose raw is the exact input."""
    events = decode_all(b"data: hello\n\n")
    assert events == [SSEEvent(raw=b"data: hello\n\n", data="hello")]


def test_multiline_data_joined_with_newline() -> None:
    """Several data lines are joined with LF, per the WHATWG example."""
    stream = b"data: YHOO\ndata: +2\ndata: 10\n\n"
    (event,) = decode_all(stream)
    assert event.data == "YHOO\n+2\n10"
    assert event.raw == stream


def test_spec_example_with_comment_and_fields() -> None:
    """The spec's comment / id / multi-line example dispatches the expected three events."""
    stream = (
        b": test stream\n\n"
        b"data: first event\nid: 1\n\n"
        b"data:second event\nid\n\n"
        b"data:  third event\n\n"
    )
    events = decode_all(stream)
    assert [e.is_comment_only for e in events] == [True, False, False, False]
    assert [e.data for e in events] == [None, "first event", "second event", " third event"]
    assert [e.id for e in events] == [None, "1", "", None]
    assert b"".join(e.raw for e in events) == stream


def test_empty_data_fields() -> None:
    """``data`` and ``data:`` without value give empty strings; two of them give one LF."""
    events = decode_all(b"data\n\ndata\ndata\n\ndata:\n\n")
    assert [e.data for e in events] == ["", "\n", ""]


def test_event_retry_and_unknown_fields() -> None:
    """``event``, ``retry`` digits are parsed; bad retry, NUL ids and unknown fields are ignored."""
    events = decode_all(
        b"event: add\nretry: 2500\nfoo: bar\ndata: x\n\n"
        b"retry: 12a\nid: a\x00b\ndata: y\n\n"
        b"event: a\nevent: b\n\n"
    )
    assert (events[0].event, events[0].retry, events[0].data) == ("add", 2500, "x")
    assert (events[1].retry, events[1].id, events[1].data) == (None, None, "y")
    assert (events[2].event, events[2].data, events[2].is_comment_only) == ("b", None, False)


def test_comment_only_block() -> None:
    """A block of only comment lines is flagged comment-only and has no fields."""
    (event,) = decode_all(b": keep-alive\n:another\n\n")
    assert event.is_comment_only
    assert event.data is None
    assert event.event is None


def test_comment_lines_inside_event_are_skipped() -> None:
    """Comment lines mixed into an event do not reach the data."""
    (event,) = decode_all(b"data: a\n: note\ndata: b\n\n")
    assert event.data == "a\nb"
    assert not event.is_comment_only


@pytest.mark.parametrize("eol", [b"\n", b"\r", b"\r\n"])
def test_line_endings(eol: bytes) -> None:
    """LF, CR and CRLF line endings all split lines and end events the same way."""
    stream = b"data: a" + eol + b"data: b" + eol + eol + b"event: e" + eol + b"data: c" + eol + eol
    for events in (decode_all(stream), bytewise(stream)):
        assert [(e.data, e.event) for e in events] == [("a\nb", None), ("c", "e")]
        assert b"".join(e.raw for e in events) == stream


def test_mixed_line_endings() -> None:
    """CR, LF and CRLF may be mixed in one stream and in one event."""
    stream = b"data: a\r\ndata: b\rdata: c\n\r\ndata: d\r\rdata: e\n\r"
    expected = [("a\nb\nc", b"data: a\r\ndata: b\rdata: c\n\r\n"), ("d", b"data: d\r\r")]
    for events in (decode_all(stream), bytewise(stream)):
        assert [(e.data, e.raw) for e in events[:2]] == expected
        assert events[2].data == "e"
        assert events[2].raw == b"data: e\n\r"


def test_crlf_split_between_cr_and_lf() -> None:
    """A CRLF blank line cut between CR and LF keeps the LF in the same event's raw."""
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r\n\r") == []
    assert decoder.pending_bytes == len(b"data: a\r\n\r")
    (event,) = decoder.feed(b"\ndata: b\r\n\r\n")[:1]
    assert event.raw == b"data: a\r\n\r\n"


def test_lone_cr_blank_line_released_by_next_byte() -> None:
    """A lone-CR blank line at the end of the data so far is dispatched once a non-LF follows."""
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r\r") == []
    events = decoder.feed(b"d")
    assert [(e.raw, e.data) for e in events] == [(b"data: a\r\r", "a")]
    assert decoder.pending_bytes == 1


def test_lone_cr_blank_line_released_by_flush() -> None:
    """A pending lone-CR-terminated event is returned by flush."""
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r\r") == []
    assert [(e.raw, e.data) for e in decoder.flush()] == [(b"data: a\r\r", "a")]


def test_many_events_in_one_chunk() -> None:
    """One chunk carrying many events returns all of them, in order."""
    stream = b"".join(b"data: %d\n\n" % i for i in range(100))
    events = SSEDecoder().feed(stream)
    assert [e.data for e in events] == [str(i) for i in range(100)]


def test_partial_event_is_pending() -> None:
    """Bytes of an unfinished event are buffered and reported by pending_bytes."""
    decoder = SSEDecoder()
    assert decoder.feed(b"data: one\n\ndata: tw") == [SSEEvent(b"data: one\n\n", "one")]
    assert decoder.pending_bytes == len(b"data: tw")
    assert decoder.feed(b"o\n") == []
    (event,) = decoder.feed(b"\n")
    assert event == SSEEvent(b"data: two\n\n", "two")
    assert decoder.pending_bytes == 0


def test_flush_returns_unterminated_event() -> None:
    """A final event without a blank line comes out of flush with the bytes received."""
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\n\ndata: last\n") == [SSEEvent(b"data: a\n\n", "a")]
    assert decoder.flush() == [SSEEvent(b"data: last\n", "last")]
    assert decoder.flush() == []


def test_flush_of_partial_line() -> None:
    """Flush parses a last line even without any line ending."""
    assert decode_all(b"data: [DONE]")[0].data == "[DONE]"


def test_split_inside_multibyte_character() -> None:
    """Cutting inside a UTF-8 sequence does not corrupt the decoded data."""
    stream = "data: 你好🙂\n\n".encode()
    for cut in range(1, len(stream)):
        (event,) = decode_all(stream, [cut])
        assert event.data == "你好🙂"


def test_invalid_utf8_is_replaced() -> None:
    """Invalid UTF-8 in data decodes with replacement characters instead of raising."""
    (event,) = decode_all(b"data: a\xff\xfeb\n\n")
    assert event.data == "a\ufffd\ufffdb"


def test_leading_bom_is_skipped_but_kept_in_raw() -> None:
    """A BOM at stream start is ignored for parsing and kept in the first event's raw."""
    stream = b"\xef\xbb\xbfdata: a\n\ndata: b\n\n"
    for events in (decode_all(stream), bytewise(stream)):
        assert [e.data for e in events] == ["a", "b"]
        assert events[0].raw == b"\xef\xbb\xbfdata: a\n\n"


def test_bom_skipped_in_flushed_first_event() -> None:
    """The BOM is also skipped when the first event only comes out of flush."""
    for stream in (b"\xef\xbb\xbfdata: x\n\r", b"\xef\xbb\xbfdata: x"):
        assert [e.data for e in decode_all(stream)] == ["x"]
        assert [e.data for e in bytewise(stream)] == ["x"]


def test_bom_only_at_stream_start() -> None:
    """A second BOM is not stripped: it becomes part of a field name."""
    events = decode_all(b"\xef\xbb\xbf\xef\xbb\xbfdata: a\n\n")
    assert events[0].data is None


def test_stray_blank_lines_travel_with_next_event() -> None:
    """Extra blank lines do not make events; they are kept in the next raw or the flush."""
    stream = b"\n\r\ndata: a\n\n\n\ndata: b\n\n\n"
    for events in (decode_all(stream), bytewise(stream)):
        assert [(e.raw, e.data) for e in events] == [
            (b"\n\r\ndata: a\n\n", "a"),
            (b"\n\ndata: b\n\n", "b"),
            (b"\n", None),
        ]


def test_empty_feed_and_empty_stream() -> None:
    """Feeding nothing returns nothing and an empty stream flushes nothing."""
    decoder = SSEDecoder()
    assert decoder.feed(b"") == []
    assert decoder.flush() == []


def test_accepts_bytearray_and_memoryview() -> None:
    """Bytes-like chunks give the same events, with ``raw`` as bytes."""
    decoder = SSEDecoder()
    events = decoder.feed(bytearray(b"data: a\n\n")) + decoder.feed(memoryview(b"data: b\n\n"))
    assert [type(e.raw) for e in events] == [bytes, bytes]
    assert [e.data for e in events] == ["a", "b"]


def test_oversize_event_raises() -> None:
    """An event growing past max_event_bytes raises SSEEventTooLarge and drops the buffer."""
    decoder = SSEDecoder(max_event_bytes=64)
    decoder.feed(b"data: " + b"x" * 40)
    with pytest.raises(SSEEventTooLarge) as info:
        decoder.feed(b"x" * 40)
    assert isinstance(info.value, SSEDecodeError)
    assert isinstance(info.value, ValueError)
    assert info.value.limit == 64
    assert decoder.pending_bytes == 0


def test_oversize_complete_event_in_one_chunk_raises() -> None:
    """A complete event larger than the limit raises too, keeping the events before it."""
    decoder = SSEDecoder(max_event_bytes=32)
    with pytest.raises(SSEEventTooLarge) as info:
        decoder.feed(b"data: ok\n\ndata: " + b"y" * 40 + b"\n\n")
    assert [e.data for e in info.value.completed] == ["ok"]


def test_event_at_limit_is_accepted() -> None:
    """An event exactly max_event_bytes long (blank line included) is fine."""
    event = b"data: " + b"z" * 10 + b"\n\n"
    decoder = SSEDecoder(max_event_bytes=len(event))
    assert decoder.feed(event * 3) == [SSEEvent(event, "z" * 10)] * 3
    assert decoder.max_event_bytes == len(event)
    assert SSEDecoder().max_event_bytes == DEFAULT_MAX_EVENT_BYTES


def test_many_small_events_do_not_trip_the_limit() -> None:
    """The limit applies per event, not to a chunk holding many events."""
    decoder = SSEDecoder(max_event_bytes=16)
    assert len(decoder.feed(b"data: 1\n\n" * 1000)) == 1000


def test_invalid_limit_rejected() -> None:
    """A non-positive max_event_bytes is a programming error."""
    with pytest.raises(ValueError, match="positive"):
        SSEDecoder(max_event_bytes=0)


_LINES = st.lists(
    st.one_of(
        st.sampled_from(
            [b"data: x", b"data:", b"data", b": c", b"event: e", b"id: 1", b"retry: 5"]
        ),
        st.binary(max_size=12).filter(lambda b: b"\r" not in b and b"\n" not in b),
    ),
    max_size=6,
)


@st.composite
def _streams(draw: st.DrawFn) -> bytes:
    """Random SSE-ish streams with random line endings (including stray blank lines)."""
    blocks = draw(st.lists(_LINES, max_size=6))
    eol = st.sampled_from([b"\n", b"\r", b"\r\n"])
    out = bytearray(draw(st.sampled_from([b"", b"\xef\xbb\xbf"])))
    for lines in blocks:
        for line in lines:
            out += line + draw(eol)
        out += draw(eol)
    out += draw(st.binary(max_size=8))
    return bytes(out)


@settings(max_examples=300, deadline=None)
@given(stream=_streams(), data=st.data())
def test_random_splits_match_whole_feed(stream: bytes, data: st.DataObject) -> None:
    """Any chunking of a stream gives the same events, and their raws rebuild the input."""
    whole = decode_all(stream)
    assert b"".join(e.raw for e in whole) == stream
    cuts = data.draw(st.lists(st.integers(1, max(1, len(stream) - 1)), max_size=20))
    assert decode_all(stream, cuts) == whole
    assert bytewise(stream) == whole


def reference_data(stream: bytes) -> list[str]:
    """Data of the events a plain WHATWG parser dispatches (whole stream at once)."""
    text = stream.decode("utf-8", "replace").removeprefix("\ufeff")
    lines = re.split(r"\r\n|\r|\n", text)
    lines.pop()  # the unterminated last line (or "") is discarded at end of stream
    out: list[str] = []
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                out.append("\n".join(data))
            data = []
            continue
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            data.append(value)
    return out


@settings(max_examples=300, deadline=None)
@given(stream=_streams())
def test_agrees_with_reference_parser(stream: bytes) -> None:
    """Dispatched data matches a straightforward spec parser.

    The flushed remainder counts only when it is an event held back for its lone-CR blank line;
    an unterminated last event is discarded by the spec (and returned by ``flush`` here).
    """
    decoder = SSEDecoder()
    events = decoder.feed(stream)
    events += [e for e in decoder.flush() if e.raw.endswith((b"\r\r", b"\n\r"))]
    assert [e.data for e in events if e.data is not None] == reference_data(stream)
