"""The session's two sub-machines, reached through :meth:`extproc.core.session.Session.handle`:
admission (:class:`extproc.core.admission_flow.Admission`) and the metered stream
(:class:`extproc.core.streaming.MeteredStream`).

The session starts each when the request gets there (admission at the body, or on an
``rpm_only`` path; the stream when the response's headers say it is metered as one) and hands
it the events of its vocabulary (:mod:`extproc.core.admission_vocabulary`,
:mod:`extproc.core.stream_vocabulary`: each names its event types); the server
feeds every event to the session and executes the actions that come back.  How a sub-machine is
built (the rules, the key prefix, the clock it reads) is the server's to inject
(:class:`Builders`): the core names what it needs here, and imports neither machine (each
imports the session).  Sans-IO.
"""

from __future__ import annotations

from typing import Any, Protocol

from extproc.core.admission_vocabulary import AdmissionAction
from extproc.core.stream_vocabulary import StreamAction


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
