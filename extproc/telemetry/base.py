"""The narrow interface the server feeds, and its no-op: what a process with no OpenTelemetry
endpoint configured runs (every call returns at once; nothing of OpenTelemetry is imported).

The server calls, per request (one :class:`RequestTrace` per ext_proc stream):

* :meth:`Telemetry.open` when the stream opens (the call's gRPC metadata: Envoy puts its trace
  context there when its tracer is on);
* :meth:`RequestTrace.start` with the request headers (the client's ``traceparent`` is the
  parent when the call carried none); it returns the ``traceparent`` header to send upstream,
  so that the engine's spans nest under the request's trace;
* :meth:`RequestTrace.mark` at a few moments (``admitted``, ``first_chunk``, ``response_end``,
  ``stream_unmetered``);
* :meth:`RequestTrace.refused` with the error a request was answered with, :meth:`charge` and
  :meth:`charge_answered` per mid-stream charge, :meth:`cut` when the gateway cut a stream;
* :meth:`RequestTrace.finish` once settled: the span and the metrics are built from the
  session's phase records there (what the request cost, which limit decided it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from extproc.core.session import Session
    from extproc.core.stream_vocabulary import Cut
    from extproc.errors import GatewayError


class RequestTrace:
    """One request's observer; this base class records nothing (tracing off)."""

    __slots__ = ()

    #: whether anything is recorded (False: every method returns at once)
    active = False

    def start(self, headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        """The request headers arrived; the headers to set upstream (``traceparent``)."""
        return ()

    def mark(self, name: str) -> None:
        """A moment of the request (an event on the span, a figure of the metrics)."""

    def refused(self, err: GatewayError) -> None:
        """The request was answered by the gateway with ``err`` (a 429, a 4xx, a 5xx)."""

    def charge(self, seq: int, amount: int, *, strict: bool) -> None:
        """A mid-stream charge of ``amount`` output tokens started."""

    def charge_answered(self, granted: int | None, *, exhausted: bool = False) -> None:
        """The charge in flight answered (``granted`` None: the limiter failed)."""

    def cut(self, action: Cut) -> None:
        """The gateway cut the stream."""

    def finish(self, s: Session) -> None:
        """The request is settled (or ended without anything to settle): emit."""


class Telemetry:
    """The process's telemetry; this base class exports nothing (tracing off)."""

    enabled = False

    def open(self, call: Any = None) -> RequestTrace:
        """A new ext_proc stream (``call``: its gRPC context, for the invocation metadata)."""
        return NOOP_TRACE

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush what is buffered and stop the exporters (at shutdown)."""


NOOP_TRACE = RequestTrace()
NOOP = Telemetry()
