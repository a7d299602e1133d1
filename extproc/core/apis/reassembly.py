"""The exact path's common part: a non-streaming request sent upstream as a stream, its
response rebuilt as the API's JSON for the client.

The meter sees every event of the stream (so an abandon, a cut or a crash settles on what
passed); the client, which asked for JSON, gets one body at the end.  :class:`BufferedStream`
keeps the bytes that passed the meter and parses them once, at the end (an abandoned
response is never parsed); each API's ``assemble`` function (beside its codec:
:mod:`extproc.core.apis.openai.reassemble`, :mod:`extproc.core.apis.responses`,
:mod:`extproc.core.apis.messages`) turns the stream's events into the response object.
Sans-IO.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from extproc.core.apis.errors import passed_error
from extproc.core.sse import SSEDecodeError, SSEDecoder

#: One stream event as the assemblers see it: its ``event:`` name and its JSON data object.
Event = tuple[str | None, dict[str, Any]]
Assemble = Callable[[list[Event]], dict[str, Any]]


def _plain_events(raw: bytes) -> list[Event] | None:
    """:func:`stream_events` of the usual stream (vLLM's, OpenAI's: LF line ends, each event
    one ``data: `` line holding one JSON object, every event ended), its JSON parsed in one
    call; None for any other (the SSE decoder's), or when the payloads are not one object
    each (then parsed one by one, a malformed one skipped)."""
    if not raw.endswith(b"\n\n") or b"\r" in raw:
        return None
    payloads = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        if not block.startswith(b"data: ") or b"\n" in block:
            return None  # a comment, an event name, a multi-line event, a stray line end
        if block != b"data: [DONE]":
            payload = block[6:]
            if not (payload.startswith(b"{") and payload.endswith(b"}")):
                return None
            payloads.append(payload)
    try:
        objs = orjson.loads(b"[" + b",".join(payloads) + b"]")
    except orjson.JSONDecodeError:
        return None
    if len(objs) != len(payloads) or not all(isinstance(obj, dict) for obj in objs):
        return None
    return [(None, obj) for obj in objs]


def stream_events(raw: bytes) -> list[Event]:
    """The JSON-object events of an SSE stream, in order (``[DONE]``, comments and data
    that is not a JSON object are skipped)."""
    plain = _plain_events(raw)
    return plain if plain is not None else decoded_events(raw)


def decoded_events(raw: bytes) -> list[Event]:
    """:func:`stream_events` by the SSE decoder, each payload parsed alone (any stream)."""
    decoder = SSEDecoder(max_event_bytes=max(1, len(raw) + 2))
    try:
        events = decoder.feed(raw) + decoder.flush()
    except SSEDecodeError:  # pragma: no cover - the limit is the whole stream
        return []
    out: list[Event] = []
    for ev in events:
        data = ev.data
        if not data or data == "[DONE]":
            continue
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            out.append((ev.event, obj))
    return out


class BufferedStream:
    """The stream's bytes, kept until its end; :meth:`body` assembles them once."""

    __slots__ = ("_assemble", "_buf")

    def __init__(self, assemble: Assemble) -> None:
        self._assemble = assemble
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        """Keep ``data`` (the per-chunk call: an append)."""
        self._buf += data

    def body(self) -> bytes:
        """The API's JSON for the whole stream."""
        return orjson.dumps(self._assemble(stream_events(bytes(self._buf))))


def concat(into: dict[str, Any], key: str, value: object) -> None:
    """Append a string delta to ``into[key]`` (created on first use; non-strings ignored)."""
    if isinstance(value, str):
        into[key] = (into.get(key) or "") + value


def error_of(events: list[Event]) -> dict[str, Any] | None:
    """An error object the upstream sent in the stream (``{"error": ...}``), if any: the
    client gets it as the body, as a non-streaming upstream would have answered."""
    for _, obj in events:
        if isinstance(obj.get("error"), dict) and obj.get("type") != "response.failed":
            return passed_error(obj["error"])
    return None
