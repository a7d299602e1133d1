"""Incremental Server-Sent-Events decoder (sans-IO) for the response hot path.

Every upstream body chunk of a streamed response goes through :meth:`SSEDecoder.feed`, which
returns the events that chunk completed.  Each :class:`SSEEvent` keeps the exact bytes it was
made of (``raw``, terminating blank line included), so the gateway can forward complete events
byte-for-byte and hold back only the incomplete tail; the concatenation of every ``raw`` handed
out (``feed`` results, then ``flush``) is exactly the byte stream that went in.

Parsing follows the WHATWG "event stream" rules: lines end with CRLF, CR or LF (mixed is fine),
a blank line ends an event, ``:`` starts a comment, ``field:value`` drops one space after the
colon, a line without colon is a field with an empty value, ``data`` lines are joined with
``\\n``, ``retry`` must be ASCII digits, an ``id`` containing NUL is ignored and one leading
UTF-8 BOM on the stream is skipped.  Field values are decoded as UTF-8 with
``errors="replace"``; the decoder never raises on bad bytes.

Deviations, all harmless for OpenAI streams: blank lines that do not end an event (stray ones
before an event's first line, or a leftover blank line at end of stream) are not dispatched on
their own but travel in the ``raw`` of the next event (or of the ``flush`` remainder), and
``id`` is reported per event rather than as the stream's persisting "last event ID".

A blank line made of a lone CR that is the last byte received so far is held until the next
byte (or :meth:`SSEDecoder.flush`) shows whether an LF follows, so that ``raw`` never depends
on where the chunks were cut.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Final

__all__ = [
    "DEFAULT_MAX_EVENT_BYTES",
    "SSEDecodeError",
    "SSEDecoder",
    "SSEEvent",
    "SSEEventTooLarge",
    "parse_event_block",
]

DEFAULT_MAX_EVENT_BYTES: Final = 1 << 20
_BOM: Final = b"\xef\xbb\xbf"
# End of a non-empty line followed by an empty line.  The first terminator may be a lone CR
# only when no LF follows it (otherwise it is the first half of a CRLF).
_EVENT_END: Final = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r|\n)")


class SSEDecodeError(ValueError):
    """The byte stream cannot be decoded as Server-Sent Events."""


class SSEEventTooLarge(SSEDecodeError):  # name fixed by the core API
    """An event grew beyond ``max_event_bytes``; the decoder has discarded its buffer."""

    def __init__(self, size: int, limit: int, completed: list[SSEEvent]) -> None:
        """Record the offending size, the limit and the events completed before the overflow."""
        super().__init__(f"SSE event of at least {size} bytes exceeds the {limit}-byte limit")
        self.size = size
        self.limit = limit
        self.completed = completed


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One event block as received, with its parsed fields."""

    raw: bytes
    data: str | None = None
    event: str | None = None
    id: str | None = None
    retry: int | None = None
    is_comment_only: bool = False


_FIELDS: Final = ("raw", "data", "event", "id", "retry", "is_comment_only")
if tuple(f.name for f in fields(SSEEvent)) != _FIELDS:  # pragma: no cover - guards an edit
    raise RuntimeError("SSEEvent fields changed: update _FIELDS and _data_event")
_new_object: Final = object.__new__
_set_raw, _set_data, _set_event, _set_id, _set_retry, _set_comment = (
    SSEEvent.__dict__[name].__set__ for name in _FIELDS
)


def _data_event(raw: bytes, data: str) -> SSEEvent:
    """``SSEEvent(raw, data)`` at half the cost of the frozen dataclass ``__init__``.

    Fills the slots directly (the hot path makes one event per upstream chunk).
    """
    event: SSEEvent = _new_object(SSEEvent)
    _set_raw(event, raw)
    _set_data(event, data)
    _set_event(event, None)
    _set_id(event, None)
    _set_retry(event, None)
    _set_comment(event, False)
    return event


def _decode(value: bytes) -> str:
    return value.decode("utf-8", "replace")


def parse_event_block(raw: bytes, start: int = 0) -> SSEEvent:
    """Parse the event whose bytes are ``raw`` (lines from ``start`` on; blank lines ignored)."""
    data: list[bytes] | None = None
    event: bytes | None = None
    ident: bytes | None = None
    retry: int | None = None
    comments = 0
    fields = 0
    for line in raw[start:].splitlines():
        if not line:
            continue
        colon = line.find(b":")
        if colon == 0:
            comments += 1
            continue
        fields += 1
        if colon < 0:
            name, value = line, b""
        else:
            name = line[:colon]
            value = line[colon + 2 :] if line[colon + 1 : colon + 2] == b" " else line[colon + 1 :]
        if name == b"data":
            if data is None:
                data = [value]
            else:
                data.append(value)
        elif name == b"event":
            event = value
        elif name == b"id":
            if b"\x00" not in value:
                ident = value
        elif name == b"retry" and value.isdigit():
            retry = int(value)
    return SSEEvent(
        raw=raw,
        data=None if data is None else _decode(b"\n".join(data)),
        event=None if event is None else _decode(event),
        id=None if ident is None else _decode(ident),
        retry=retry,
        is_comment_only=comments > 0 and fields == 0,
    )


class SSEDecoder:
    """Turn a stream of byte chunks into :class:`SSEEvent` objects, buffering at most one event.

    ``feed`` is the hot path: for LF-only streams it finds event ends with ``bytes.find`` and
    never rescans bytes it has already searched; the general CR/CRLF handling only runs while
    the buffered bytes contain a CR.
    """

    __slots__ = ("_at_start", "_buf", "_content", "_has_cr", "_max", "_scan")

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        """Create a decoder that rejects events larger than ``max_event_bytes`` bytes."""
        if max_event_bytes <= 0:
            raise ValueError("max_event_bytes must be positive")
        self._max = max_event_bytes
        self._reset()

    def _reset(self) -> None:
        self._buf = bytearray()
        # Offset in _buf of the first non-blank line of the pending event, -1 if not seen yet.
        self._content = -1
        # Offset in _buf where the search (for content or for the event end) resumes.
        self._scan = 0
        # Whether the pending bytes contain a CR (sticky until the buffer drains).
        self._has_cr = False
        self._at_start = True

    @property
    def max_event_bytes(self) -> int:
        """The size limit of one event, terminating blank line included."""
        return self._max

    @property
    def pending_bytes(self) -> int:
        """Bytes received but not yet part of a returned event."""
        return len(self._buf)

    def feed(self, chunk: bytes | bytearray | memoryview) -> list[SSEEvent]:
        """Add ``chunk`` and return the events it completed (possibly none)."""
        if type(chunk) is not bytes:
            chunk = bytes(chunk)
        if not chunk:
            return []
        own = self._buf
        if not own and not self._at_start:
            # The usual chunk, nothing pending: exactly one ``data: ...`` line and its blank
            # line, LF only (its first LF is the line's end, the last byte the blank line).
            n = len(chunk)
            if (
                chunk.find(10) == n - 2
                and chunk[-1] == 10
                and chunk.startswith(b"data: ")
                and n <= self._max
                and 13 not in chunk
            ):
                return [_data_event(chunk, chunk[6:-2].decode("utf-8", "replace"))]
        buf: bytes | bytearray
        if own:
            own += chunk
            buf = own
        else:
            buf = chunk
        n = len(buf)
        scan = self._scan
        if self._at_start:
            if n < 3 and _BOM.startswith(buf):
                if buf is not own:
                    own += buf
                return []
            self._at_start = False
            if buf.startswith(_BOM):
                scan = 3
        # ``int in bytes`` and ``bytes.find(int)`` are memchr calls: much cheaper than searching
        # for a two-byte needle.  10 is LF, 13 is CR.
        has_cr = self._has_cr or 13 in chunk
        content = self._content
        limit = self._max
        events: list[SSEEvent] = []
        pos = 0
        while True:
            if content < 0:
                i = scan
                while i < n and (buf[i] == 10 or buf[i] == 13):
                    i += 1
                scan = i
                if i == n:
                    break
                content = i
            single_line = False
            if has_cr:
                m = _EVENT_END.search(buf, scan if scan > content else content)
                if m is None:
                    scan = max(content, n - 3)
                    break
                end = m.end()
                if end == n and buf[end - 1] == 13:
                    # Lone-CR blank line at the end of the data so far: an LF may follow.
                    scan = m.start()
                    break
            else:
                first = scan <= content
                i = buf.find(10, content if first else scan)
                while i >= 0:
                    if i + 1 == n:
                        break
                    if buf[i + 1] == 10:
                        break
                    first = False
                    i = buf.find(10, i + 2)
                if i < 0 or i + 1 == n:
                    scan = n - 1 if n - 1 > content else content
                    break
                end = i + 2
                single_line = first
            if end - pos > limit:
                self._reset()
                self._at_start = False
                raise SSEEventTooLarge(end - pos, limit, events)
            raw = buf[pos:end] if buf is chunk else bytes(buf[pos:end])
            start = content - pos
            if single_line and raw.startswith(b"data: ", start):
                # Fast path: the usual event, one ``data: ...`` line and LF LF.
                events.append(_data_event(raw, raw[start + 6 : -2].decode("utf-8", "replace")))
            else:
                events.append(parse_event_block(raw, start))
            pos = scan = end
            content = -1
        if n - pos > limit:
            self._reset()
            self._at_start = False
            raise SSEEventTooLarge(n - pos, limit, events)
        if pos == n:
            if buf is own:
                own.clear()
            self._content = -1
            self._scan = 0
            self._has_cr = False
        else:
            if buf is own:
                if pos:
                    del own[:pos]
            else:
                own += buf[pos:] if pos else buf
            self._content = content - pos if content >= 0 else -1
            self._scan = scan - pos
            self._has_cr = has_cr
        return events

    def flush(self) -> list[SSEEvent]:
        """End of stream: return the unterminated remainder as a final event, then reset."""
        buf = bytes(self._buf)
        # Where the first line of the pending event starts (after stray blank lines and the
        # stream's BOM); none yet means the remainder holds no line with a field.
        start = self._content if self._content >= 0 else len(buf)
        self._reset()
        if not buf:
            return []
        return [parse_event_block(buf, start)]
