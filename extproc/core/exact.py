"""The exact path's response, sans-IO: a non-streaming request the gateway sent upstream as a
stream with usage (:attr:`extproc.core.admission_plan.Cost.upstream_stream`).

Its bytes are kept as they pass (one append per chunk: nothing is parsed, counted or sent
back while the upstream generates, so a chunk costs the processor one ext_proc message and
no reply).  At the stream's end the API's reassembler (:mod:`extproc.core.apis.reassembly`)
rebuilds the JSON the client asked for, whose usage is read as a JSON response's is (within
the same bounds).  When the request ends before that (the client left, the upstream reset,
the processor stops) :meth:`ExactResponse.end` counts what passed with the model's stream
meter, once: the bill is what the engine generated until it stopped, not a rate.
"""

from __future__ import annotations

import zlib

from extproc.core.apis.base import Reassembler
from extproc.core.encoding import BodyDecoder
from extproc.core.meter import StreamMeter
from extproc.core.phase_records import Reported, StreamEnd
from extproc.core.session import Session


class ExactResponse:
    """One exact-path response: its bytes until its end, then its JSON."""

    __slots__ = ("_body", "_decoder", "_raw", "_rebuild", "s")

    def __init__(self, s: Session, decoder: BodyDecoder | None = None) -> None:
        api, cost = s.api, s.cost
        assert api is not None and cost is not None and cost.upstream_stream
        self.s = s
        self._decoder = decoder
        self._raw = bytearray()
        self._rebuild: Reassembler = api.reassembler()
        self._body: bytes | None = None

    @property
    def done(self) -> bool:
        """The stream ended and its JSON was rebuilt."""
        return self._body is not None

    def chunk(self, data: bytes, end: bool) -> bytes | None:
        """Keep one chunk; at the end (``end``) the client's JSON body, its usage reported to
        the session.  A body that cannot be decompressed is rebuilt from what decoded."""
        if self._body is not None:
            return None
        if self._decoder is not None:
            try:
                data = self._decoder.feed(data) + (self._decoder.flush() if end else b"")
            except zlib.error:
                data = b""
        self._raw += data
        if not end:
            return None
        return self.finish()

    def finish(self) -> bytes:
        """The client's JSON (once; the upstream ended, with its body or its trailers)."""
        if self._body is None:
            s = self.s
            api = s.api
            assert api is not None
            self._rebuild.feed(bytes(self._raw))
            body = self._rebuild.body()
            usage = api.json_usage(body)
            if usage is not None:
                s.report(Reported.of(usage))
            self._body = body
        return self._body

    def end(self) -> StreamEnd | None:
        """What settlement bills: None once the JSON was rebuilt (its usage, as a JSON
        response's); before that, the tokens that passed, counted by the model's stream
        meter over the kept bytes (the request ended early: the upstream stopped there)."""
        if self._body is not None:
            return None
        s = self.s
        cost, req, api, model = s.cost, s.req, s.api, s.model
        assert cost is not None and req is not None and api is not None and model is not None
        meter = StreamMeter(
            count=model.stream_counter(),
            every=cost.every,
            strict=False,
            enforce=False,
            initial_lease=cost.reserved_output,
            strip_usage=False,
            read=api.stream_reader().read,
            engine_counts=model.continuous_usage and api.name in ("chat", "completions"),
        )
        meter.feed(bytes(self._raw), False)
        return StreamEnd(
            counted=meter.counted,
            delivered=meter.delivered,
            complete=False,
            cut=False,
            text_events=meter.stats.text_events,
        )
