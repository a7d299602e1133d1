"""The request's envelope as events in, actions out: what the server reports of one HTTP
request (its headers, its body, admission's yes, the response's headers, a JSON body read to its
end, trailers, the gRPC stream's close, settlement) and what it must do next.

:meth:`extproc.core.session.Session.handle` takes each :data:`EnvelopeEvent`, moves the
session's lifecycle (:mod:`extproc.core.lifecycle`) and records, and returns the
:data:`EnvelopeAction` tuple the server executes in order: which response headers go back, in
which body mode, with which figures; when the metered stream (:mod:`extproc.core.streaming`),
the exact path's rebuild (:mod:`extproc.core.exact`) or a JSON body's read start; when the
input figure must be ready (:mod:`extproc.core.bound_count`) and when settlement starts.  The
session's two sub-machines, admission (:mod:`extproc.core.admission_flow`) and the metered
stream (:mod:`extproc.core.streaming`), take their own events through the same
:meth:`~extproc.core.session.Session.handle` (:mod:`extproc.core.sub_machines`); the session
starts the stream here, with the response's headers.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from extproc.core.figures import Figure
from extproc.core.lifecycle import Closed, CutReason, Ending
from extproc.core.phase_records import Identified, Metering, Reported, Requested
from extproc.errors import GatewayError, UnmeterableResponse


class Session(Protocol):
    """What the envelope moves of :class:`extproc.core.session.Session` (its lifecycle and
    records; named here so that the session may import this module)."""

    @property
    def headers_out(self) -> tuple[tuple[str, str], ...]: ...
    @property
    def ended(self) -> bool: ...
    def request_headers(self) -> None: ...
    def request(self, rec: Requested) -> None: ...
    def identify(self, rec: Identified) -> None: ...
    def pass_through(self) -> None: ...
    def request_body(self) -> None: ...
    def admission_done(self) -> None: ...
    def count_input_with(self, count: Callable[[], int], *, inline: bool = True) -> None: ...
    def input_counted(self, exact: int) -> None: ...
    def start_stream(self, decoder: Any) -> None: ...
    def answered(self, *, refused: bool) -> None: ...
    def response_headers(
        self, headers: dict[str, str], *, end_of_stream: bool, fail_open: bool
    ) -> Metering: ...
    def response_body(self) -> None: ...
    def report(self, rec: Reported) -> None: ...
    def json_output(self) -> Figure | None: ...
    def response_read(self) -> None: ...
    def response_trailers(self) -> None: ...
    def stream_closed(self, how: Closed, *, stream_complete: bool = False) -> Ending: ...
    def begin_settlement(self) -> bool: ...
    def settle_ending(self) -> Ending: ...


# -- events: what the server reports ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestHeaders:
    """The request's headers arrived, with its own facts (id, path, API)."""

    requested: Requested


@dataclass(frozen=True, slots=True)
class CallerIdentified:
    """The caller is identified (who calls, the API, the ledger)."""

    identified: Identified


@dataclass(frozen=True, slots=True)
class PassThrough:
    """The path is not metered (public, or not a metered API): the request passes as it is."""


@dataclass(frozen=True, slots=True)
class RequestBody:
    """The request's body arrived (admission follows)."""


@dataclass(frozen=True, slots=True)
class AdmissionDone:
    """Admission said yes (its record is set): the request goes upstream."""


@dataclass(frozen=True, slots=True)
class CountPrepared:
    """Admitted on an upper bound of the input: ``count`` takes the exact count (``inline``:
    cheap enough to run on the event loop when a figure needs it; else the server counts in a
    worker thread first)."""

    count: Callable[[], int]
    inline: bool


@dataclass(frozen=True, slots=True)
class BoundCounted:
    """The exact count of a prompt admitted on a bound was taken (or the bound stands for a
    count that could not finish: ``exact`` is then the bound): it replaces the bound."""

    exact: int


@dataclass(frozen=True, slots=True)
class Answered:
    """The gateway answered the request itself: refused (429) or rejected (any other error)."""

    refused: bool


@dataclass(frozen=True, slots=True)
class ResponseHeaders:
    """The response's headers arrived (the input figure the access log shows is known)."""

    headers: dict[str, str]
    end_of_stream: bool
    fail_open: bool


@dataclass(frozen=True, slots=True)
class ResponseChunk:
    """A response body chunk that the metered stream does not take arrived."""


@dataclass(frozen=True, slots=True)
class BodyRead:
    """A JSON body (read, or rebuilt by the exact path) is whole; ``reported`` is its usage
    (None: none read, or already reported chunk by chunk)."""

    reported: Reported | None = None


@dataclass(frozen=True, slots=True)
class ResponseDone:
    """The JSON body's figures are ready: the response is over."""


@dataclass(frozen=True, slots=True)
class ResponseTrailers:
    """The response's trailers arrived."""


@dataclass(frozen=True, slots=True)
class StreamClosed:
    """The gRPC stream closed; ``stream_complete``: a metered stream's terminal event reached
    the client first."""

    how: Closed
    stream_complete: bool = False


@dataclass(frozen=True, slots=True)
class ResponseOver:
    """The response is over, or the stream closed: settle, once."""


@dataclass(frozen=True, slots=True)
class SettlementStarts:
    """The background settlement begins: the ending is named (completed when nothing else
    was)."""


EnvelopeEvent = (
    RequestHeaders
    | CallerIdentified
    | PassThrough
    | RequestBody
    | AdmissionDone
    | CountPrepared
    | BoundCounted
    | Answered
    | ResponseHeaders
    | ResponseChunk
    | BodyRead
    | ResponseDone
    | ResponseTrailers
    | StreamClosed
    | ResponseOver
    | SettlementStarts
)

# -- actions: what the server does, in order --------------------------------------------------


class BodyMode(enum.Enum):
    """How Envoy sends the response body from now on."""

    UNCHANGED = "unchanged"
    FULL_DUPLEX = "full_duplex"  # chunk by chunk, the gateway forwards (metered, exact)
    STREAMED = "streamed"  # chunk by chunk, Envoy forwards (a JSON body read for usage)


class Figures(enum.Enum):
    """Which dynamic metadata (the access log's figures) goes with a response."""

    NONE = "none"
    SO_FAR = "so_far"  # the request's figures as they stand
    NO_OUTPUT = "no_output"  # an upstream error: no output generated


@dataclass(frozen=True, slots=True)
class ForwardHeaders:
    """Continue the response with these headers added and ``remove`` taken off."""

    headers: tuple[tuple[str, str], ...] = ()
    remove: tuple[str, ...] = ()
    mode: BodyMode = BodyMode.UNCHANGED
    figures: Figures = Figures.NONE


@dataclass(frozen=True, slots=True)
class FiguresReady:
    """Make the input figure ready (count a prompt admitted on a bound if a figure needs it)."""


@dataclass(frozen=True, slots=True)
class CountInput:
    """The response is metered: count a prompt admitted on a bound now, when its figure may
    not stand uncounted (:meth:`extproc.server.counting.BoundCounting.response_metered`)."""


@dataclass(frozen=True, slots=True)
class MeterStream:
    """Meter the response body as a stream: the session's metered stream started (it is fed
    through :meth:`~extproc.core.session.Session.handle`); the server sets up its I/O."""


@dataclass(frozen=True, slots=True)
class RebuildJson:
    """Keep the stream a non-stream request was sent upstream as; rebuild its JSON."""

    decoder: Any


@dataclass(frozen=True, slots=True)
class ReadJson:
    """Read the JSON body for its usage as Envoy forwards it."""

    decoder: Any


@dataclass(frozen=True, slots=True)
class Unmetered:
    """A 2xx response the meter cannot read passes unmetered (the plan fails open): logged."""

    reason: str


@dataclass(frozen=True, slots=True)
class Reject:
    """Answer the request with ``error`` (the API's own error response); ``cut``: a response
    cut before the client saw it, counted as such."""

    error: GatewayError
    cut: CutReason | None = None


@dataclass(frozen=True, slots=True)
class Settle:
    """The response is over: settle (the server asks :class:`ResponseOver`, which answers
    once)."""


@dataclass(frozen=True, slots=True)
class StartSettlement:
    """Settlement begins (the first time it is asked): the server starts it in the
    background, after the current response is sent."""


EnvelopeAction = (
    ForwardHeaders
    | FiguresReady
    | CountInput
    | MeterStream
    | RebuildJson
    | ReadJson
    | Unmetered
    | Reject
    | Settle
    | StartSettlement
)

Actions = tuple[EnvelopeAction, ...]
_NONE: Actions = ()
_STREAMING = ("content-length", "content-encoding")
_METER_STREAM = MeterStream()


def handle(s: Session, event: EnvelopeEvent) -> Actions:
    """One envelope event: the session moves, the server does what comes back."""
    match event:
        case RequestHeaders(requested):
            s.request_headers()
            s.request(requested)
        case CallerIdentified(identified):
            s.identify(identified)
        case PassThrough():
            s.pass_through()
        case RequestBody():
            s.request_body()
        case AdmissionDone():
            s.admission_done()
        case CountPrepared(count, inline):
            s.count_input_with(count, inline=inline)
        case BoundCounted(exact):
            s.input_counted(exact)
        case Answered(refused):
            s.answered(refused=refused)
        case ResponseHeaders():
            return _response_headers(s, event)
        case ResponseChunk():
            s.response_body()
        case BodyRead(reported):
            if reported is not None:
                s.report(reported)
            # the output is decided once: the access log and settlement read it, with the
            # input figure beside it
            return (FiguresReady(),) if s.json_output() is not None else _NONE
        case ResponseDone():
            s.response_read()
            return (Settle(),)
        case ResponseTrailers():
            s.response_trailers()
        case StreamClosed(how, complete):
            s.stream_closed(how, stream_complete=complete)
            return (Settle(),)
        case ResponseOver():
            return (StartSettlement(),) if s.begin_settlement() else _NONE
        case SettlementStarts():
            s.settle_ending()
    return _NONE


def _response_headers(s: Session, event: ResponseHeaders) -> Actions:
    """How the response goes on (:func:`extproc.core.classify.classify`, through the session)."""
    how = s.response_headers(
        event.headers, end_of_stream=event.end_of_stream, fail_open=event.fail_open
    )
    out = tuple(s.headers_out)
    kind = how.kind
    if kind == "local_reply":  # Envoy's own reply (413 before the body reached us...)
        return (ForwardHeaders(),)
    if kind == "unmetered":  # unmetered path, or admitted unmetered (fail-open)
        return (ForwardHeaders(out),)
    if kind == "upstream_error":  # the access log's input figure, no output
        return (FiguresReady(), Settle(), ForwardHeaders(out, figures=Figures.NO_OUTPUT))
    if kind == "unmeterable":
        if s.ended:  # the plan fails open: the session let it pass (and ended it)
            return (Unmetered(how.reason), Settle(), ForwardHeaders(out))
        error = UnmeterableResponse(
            f"The upstream answered with {how.reason}, which the gateway cannot meter; the "
            "response was not delivered. Ask the operator to fix the upstream."
        )
        return (Reject(error, CutReason.UNMETERABLE),)
    if kind == "stream":  # SSE, or SSE under a missing/odd content type
        s.start_stream(how.decoder)  # the stream's machine, fed through the session
        duplex = ForwardHeaders(out, _STREAMING, BodyMode.FULL_DUPLEX, Figures.SO_FAR)
        return (CountInput(), _METER_STREAM, duplex)
    if kind == "exact":  # a non-stream sent upstream as a stream: JSON rebuilt
        json = (*out, ("content-type", "application/json"))
        duplex = ForwardHeaders(json, _STREAMING, BodyMode.FULL_DUPLEX, Figures.SO_FAR)
        return (CountInput(), RebuildJson(how.decoder), duplex)
    if kind == "read_json":
        streamed = ForwardHeaders(out, (), BodyMode.STREAMED, Figures.SO_FAR)
        return (CountInput(), ReadJson(how.decoder), streamed)
    # nothing to read: the response ended with its headers
    return (CountInput(), Settle(), ForwardHeaders(out, figures=Figures.SO_FAR))
