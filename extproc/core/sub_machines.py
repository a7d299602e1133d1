"""The session's two sub-machines, reached through :meth:`extproc.core.session.Session.handle`:
admission (:class:`extproc.core.admission_flow.Admission`) and the metered stream
(:class:`extproc.core.streaming.MeteredStream`).

The session starts each when the request gets there (admission at the body, or on an
``rpm_only`` path; the stream when the response's headers say it is metered as one) and hands
it the events of its vocabulary (:data:`ADMISSION_EVENTS`, :data:`STREAM_EVENTS`); the server
feeds every event to the session and executes the actions that come back.  How a sub-machine is
built (the rules, the key prefix, the clock it reads) is the server's to inject
(:class:`Builders`): the core names what it needs here, and imports neither machine (each
imports the session).  Sans-IO.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

from extproc.core.actions import AdmissionAction, StreamAction
from extproc.core.events import (
    AdmitAnswered,
    AdmitBacklogged,
    AdmitCancelled,
    AdmitFailed,
    BodyArrived,
    BodyChunk,
    ChargeAbandoned,
    ChargeAnswered,
    ChargeFailed,
    CountDone,
    CutNow,
    InputCounted,
    RpmOnlyArrived,
    Trailers,
    TurnCame,
    WaitDeclined,
)

#: The admission's events: the two that start it, then the answers to what it asked.
ADMISSION_EVENTS: Final = frozenset(
    (
        BodyArrived,
        RpmOnlyArrived,
        InputCounted,
        AdmitAnswered,
        AdmitFailed,
        AdmitCancelled,
        AdmitBacklogged,
        TurnCame,
        WaitDeclined,
    )
)
#: The metered stream's events.
STREAM_EVENTS: Final = frozenset(
    (BodyChunk, Trailers, ChargeAnswered, ChargeFailed, ChargeAbandoned, CountDone, CutNow)
)


class AdmissionMachine(Protocol):
    """What the session asks of its admission."""

    def handle(self, ev: Any) -> list[AdmissionAction]: ...


class StreamMachine(Protocol):
    """What the session asks of its metered stream."""

    def handle(self, ev: Any) -> list[StreamAction]: ...


class Builders(Protocol):
    """How the server builds a request's sub-machines (the session is passed as ``s``; the
    stream's ``decoder`` undoes the response's content encoding, None: identity)."""

    def admission(self, s: Any) -> AdmissionMachine: ...
    def stream(self, s: Any, decoder: Any) -> StreamMachine: ...
