"""A response body that is not a metered stream, read for its figures: a JSON body's usage read
as Envoy forwards it (streamed mode), or the stream a non-stream request was sent upstream as,
kept and rebuilt as JSON (:mod:`extproc.core.exact`).  Its end is the envelope's
:class:`~extproc.core.envelope.BodyRead` and :class:`~extproc.core.envelope.ResponseDone`
events; what they ask is executed by the processor (``events``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from extproc.core.envelope import BodyRead, EnvelopeEvent, ResponseDone, ResponseTrailers
from extproc.core.exact import ExactResponse
from extproc.core.phase_records import Reported, StreamEnd
from extproc.core.session import Session
from extproc.server import wire
from extproc.server.settle import access_metadata

# Non-streaming JSON bodies read for their usage are buffered up to this size.
MAX_USAGE_BODY = 8 << 20


class ResponseBody:
    """One response's body, read for its usage (``exact``: rebuilt from a kept stream)."""

    __slots__ = ("_buf", "_decoder", "_events", "exact", "s")

    def __init__(
        self,
        s: Session,
        events: Callable[..., Awaitable[None]],
        decoder: Any,
        *,
        exact: bool,
    ) -> None:
        self.s = s
        self._events = events
        self._decoder = decoder
        self._buf = bytearray()
        self.exact = ExactResponse(s, decoder) if exact else None

    async def chunk(self, data: bytes, end: bool) -> list[wire.ProcessingResponse]:
        """One chunk: kept (exact), or passed and buffered (JSON); the answer at the end."""
        s = self.s
        exact = self.exact
        if exact is not None:
            if not s.reading:
                return []
            body_out = exact.chunk(data, end)
            if body_out is None:
                return []  # kept: nothing goes back while the upstream generates
            return [wire.streamed_body(body_out, True, await self._read())]
        if not s.reading:
            return [wire.continue_response_body()]
        if len(self._buf) < MAX_USAGE_BODY:
            self._buf += data
        if not end:
            return [wire.continue_response_body()]
        reported = _json_usage(s, bytes(self._buf), self._decoder)
        return [wire.continue_response_body(await self._read(reported))]

    async def trailers(self) -> list[wire.ProcessingResponse] | None:
        """The exact path's JSON, rebuilt before the trailers pass (None: nothing to send)."""
        exact = self.exact
        if exact is None or not self.s.reading:
            return None
        body_out = exact.finish()
        self.s.handle(ResponseTrailers())
        return [
            wire.streamed_body(body_out, False, await self._read()),
            wire.continue_response_trailers(),
        ]

    def end(self) -> StreamEnd | None:
        """How a kept stream ended, for settlement (None once its JSON was rebuilt, or for a
        JSON body: read as JSON)."""
        return self.exact.end() if self.exact is not None else None

    async def _read(self, reported: Reported | None = None) -> dict[str, object]:
        """The JSON body is whole (read, or rebuilt): its figures, the end."""
        events: tuple[EnvelopeEvent, ...] = (BodyRead(reported), ResponseDone())
        await self._events(*events)
        return access_metadata(self.s, output_tokens=self.s.output_decided)


def _json_usage(s: Session, raw: bytes, decoder: Any) -> Reported | None:
    """A whole JSON body's usage (None: none, or a body too corrupt to read)."""
    assert s.api is not None
    try:
        plain = decoder.feed(raw) + decoder.flush() if decoder is not None else raw
    except Exception:  # a corrupt body has no usage to read
        plain = b""
    usage = s.api.json_usage(plain)
    return Reported.of(usage) if usage is not None else None
