"""One request's phase machine: the only place a request's ext_proc phase, its ending, its cut
reason and whether its settlement has begun change.  The rest of a request's state lives in
the other machines and records of the core: the session's phase records and its input's
standing (:mod:`extproc.core.session`, :mod:`extproc.core.input_state`), the admission flow (:mod:`extproc.core.admission_flow`), the metered
stream (:mod:`extproc.core.streaming`) and its meter's phase (:mod:`extproc.core.meter_phase`).

States follow the ext_proc phases (an h2-style transition table, :data:`TRANSITIONS`); an input
not listed for the current state is a protocol violation (Envoy sent messages out of order),
raised as :class:`LifecycleError`.  Besides the phase, the machine owns how the request ended
(:class:`Ending`, set once: the first ending named wins), why a stream was cut
(:class:`CutReason`) and whether settlement has begun (once).  Everything else reads them.

The servicer reports how the gRPC stream closed with :meth:`Lifecycle.close`; the machine
names the ending from the phase it was in, so nobody has to infer it from other objects.
"""

from __future__ import annotations

from enum import Enum


class State(Enum):
    """Where a request is."""

    # Members are singletons compared by identity: hash them by identity too (C-level),
    # not by Enum's Python-level ``hash(self._name_)``; every message looks up a transition.
    __hash__ = object.__hash__

    AWAIT_HEADERS = "await_headers"
    AWAIT_BODY = "await_body"
    ADMITTED = "admitted"
    PASSTHROUGH = "passthrough"
    RESPONDING = "responding"  # response headers seen; a body may follow
    READING = "reading"  # a non-streaming body is read for its usage
    STREAMING = "streaming"
    CUT = "cut"
    DONE = "done"


class Input(Enum):
    """What happened."""

    __hash__ = object.__hash__  # as State's

    REQUEST_HEADERS = "request_headers"
    REQUEST_BODY = "request_body"
    REFUSED = "refused"
    ADMITTED = "admitted"
    PASS = "pass"  # noqa: S105 - not a password
    RESPONSE_HEADERS = "response_headers"
    READ_BODY = "read_body"
    STREAM_START = "stream_start"
    RESPONSE_BODY = "response_body"
    TRAILERS = "trailers"
    CUT = "cut"
    END = "end"


class Ending(Enum):
    """How a request ended (the value is what logs and access logs show)."""

    COMPLETED = "completed"
    CUT = "cut"
    REFUSED = "refused"  # 429 at admission
    REJECTED = "rejected"  # any other error answered by the gateway
    PASSTHROUGH = "passthrough"  # an unmetered path
    LOCAL_REPLY = "local_reply"  # Envoy answered before the body reached us (413, 503 ...)
    UPSTREAM_ERROR = "upstream_error"  # a non-2xx response
    # the response broke off upstream: kept for records written before 2026-12; the processor
    # cannot tell it from a client leaving (see Lifecycle.close) and names that instead
    UPSTREAM_RESET = "upstream_reset"
    CLIENT_DISCONNECTED = "client_disconnected"
    SHUTDOWN = "shutdown"  # the processor stopped before the response ended
    INTERNAL_ERROR = "internal_error"


class CutReason(Enum):
    """Why the gateway ended a stream itself."""

    QUOTA_EXHAUSTED = "quota_exhausted"
    BACKEND_UNAVAILABLE = "quota_backend_unavailable"
    EVENT_TOO_LARGE = "upstream_event_too_large"
    SHUTDOWN = "server_shutdown"
    UNMETERABLE = "unmeterable_response"


class Closed(Enum):
    """How the gRPC stream carrying the request closed."""

    EOF = "eof"  # Envoy half-closed: it has nothing more to send
    CANCELLED = "cancelled"  # Envoy reset the stream (client gone, timeout, Envoy stopping)
    ERROR = "error"  # the processor failed
    SHUTDOWN = "shutdown"  # the processor is stopping


S, In = State, Input

TRANSITIONS: dict[tuple[State, Input], State] = {
    (S.AWAIT_HEADERS, In.REQUEST_HEADERS): S.AWAIT_BODY,
    (S.AWAIT_HEADERS, In.REFUSED): S.DONE,
    # Envoy rejected the request itself (a path it will not normalise, a bad upgrade ...):
    # its local reply is all we see.
    (S.AWAIT_HEADERS, In.RESPONSE_HEADERS): S.RESPONDING,
    (S.AWAIT_BODY, In.REQUEST_BODY): S.AWAIT_BODY,
    (S.AWAIT_BODY, In.ADMITTED): S.ADMITTED,
    (S.AWAIT_BODY, In.REFUSED): S.DONE,
    (S.AWAIT_BODY, In.PASS): S.PASSTHROUGH,
    # Envoy's own local reply (413, 503...) arrives without the body ever reaching us.
    (S.AWAIT_BODY, In.RESPONSE_HEADERS): S.RESPONDING,
    (S.ADMITTED, In.RESPONSE_HEADERS): S.RESPONDING,
    (S.PASSTHROUGH, In.RESPONSE_HEADERS): S.RESPONDING,
    (S.PASSTHROUGH, In.RESPONSE_BODY): S.PASSTHROUGH,
    (S.PASSTHROUGH, In.TRAILERS): S.PASSTHROUGH,
    (S.PASSTHROUGH, In.END): S.DONE,
    (S.RESPONDING, In.STREAM_START): S.STREAMING,
    (S.RESPONDING, In.READ_BODY): S.READING,
    (S.RESPONDING, In.RESPONSE_BODY): S.RESPONDING,
    (S.RESPONDING, In.TRAILERS): S.RESPONDING,
    (S.RESPONDING, In.CUT): S.CUT,
    (S.RESPONDING, In.END): S.DONE,
    (S.READING, In.RESPONSE_BODY): S.READING,
    (S.READING, In.TRAILERS): S.READING,
    (S.READING, In.END): S.DONE,
    (S.STREAMING, In.RESPONSE_BODY): S.STREAMING,
    (S.STREAMING, In.TRAILERS): S.STREAMING,
    (S.STREAMING, In.CUT): S.CUT,
    (S.STREAMING, In.END): S.DONE,
    (S.CUT, In.RESPONSE_BODY): S.CUT,
    (S.CUT, In.TRAILERS): S.CUT,
    (S.CUT, In.END): S.CUT,
    (S.DONE, In.END): S.DONE,
    (S.DONE, In.RESPONSE_BODY): S.DONE,
    (S.DONE, In.TRAILERS): S.DONE,
}
# The gateway answers the request itself (an immediate 4xx/5xx response) from any phase after
# the headers: an error while responding ends the request there.
TRANSITIONS.update(
    {
        (state, In.REFUSED): S.DONE
        for state in (S.ADMITTED, S.PASSTHROUGH, S.RESPONDING, S.READING, S.STREAMING, S.CUT)
    }
)
TRANSITIONS[(S.DONE, In.REFUSED)] = S.DONE

# The ending a transition names (when none was named before).
ENDING_OF: dict[Input, Ending] = {
    In.CUT: Ending.CUT,
    In.END: Ending.COMPLETED,
}

# A response was under way in these states: a close is a disconnect or a reset.
_RESPONSE_UNDER_WAY = (S.READING, S.STREAMING, S.RESPONDING)


class LifecycleError(RuntimeError):
    """An input that is not valid in the current state."""


class Lifecycle:
    """One request's state, ending, cut reason and settlement flag; changed only through here."""

    __slots__ = ("_cut_reason", "_ending", "_settling", "_state")

    def __init__(self, state: State = State.AWAIT_HEADERS) -> None:
        self._state = state
        self._ending: Ending | None = None
        self._cut_reason: CutReason | None = None
        self._settling = False

    @property
    def state(self) -> State:
        """The current phase."""
        return self._state

    @property
    def ending(self) -> Ending | None:
        """How the request ended, once it has."""
        return self._ending

    @property
    def cut_reason(self) -> CutReason | None:
        """Why the stream was cut, if it was."""
        return self._cut_reason

    @property
    def ended(self) -> bool:
        """The response is over (completed, cut or answered by the gateway): the one answer to
        "is the stream over?"."""
        return self._state in (S.DONE, S.CUT)

    @property
    def settling(self) -> bool:
        """Settlement has begun (it begins once)."""
        return self._settling

    def advance(self, inp: Input) -> State:
        """Apply ``inp``; raise :class:`LifecycleError` when it is not allowed."""
        nxt = TRANSITIONS.get((self._state, inp))
        if nxt is None:
            raise LifecycleError(f"{inp.value} is not valid in state {self._state.value}")
        self._state = nxt
        named = ENDING_OF.get(inp)
        if named is not None and self._ending is None:
            self._ending = named
        return nxt

    def name_ending(self, ending: Ending) -> None:
        """Record how the request ended; the first ending named stays."""
        if self._ending is None:
            self._ending = ending

    def refuse(self, ending: Ending) -> None:
        """The gateway answered the request itself (a 4xx/5xx immediate response).

        Before the request was admitted it is refused; afterwards (an error while responding)
        the ending is recorded and the phase moves to DONE."""
        self.advance(In.REFUSED)
        self.name_ending(ending)

    def cut(self, reason: CutReason) -> None:
        """The gateway ends a metered response itself."""
        self.advance(In.CUT)
        if self._cut_reason is None:
            self._cut_reason = reason

    def close(self, how: Closed) -> Ending:
        """The gRPC stream closed: name the ending (if none yet) from the phase it was in."""
        if self._ending is None:
            if how is Closed.SHUTDOWN:
                ending = Ending.SHUTDOWN
            elif how is Closed.ERROR:
                ending = Ending.INTERNAL_ERROR
            elif self._state in _RESPONSE_UNDER_WAY:
                # Envoy 1.40 half-closes or cancels the processor's stream for a client that
                # leaves and for an upstream that resets alike (measured: either way for
                # either cause), so the close says nothing about the cause; the client
                # leaving is by far the common one (Envoy's access log flags DC / UR tell).
                ending = Ending.CLIENT_DISCONNECTED
            elif self._state is S.PASSTHROUGH:
                ending = Ending.PASSTHROUGH
            else:
                # Before any response: the client (or Envoy's timeout) gave up waiting.
                ending = Ending.CLIENT_DISCONNECTED
            self._ending = ending
        assert self._ending is not None
        return self._ending

    def begin_settlement(self) -> bool:
        """True the first time (the caller settles), False afterwards."""
        if self._settling:
            return False
        self._settling = True
        return True
