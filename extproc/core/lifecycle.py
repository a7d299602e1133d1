"""The request lifecycle as a transition table.

States follow the ext_proc phases; an input not listed for the current state is a protocol
violation (Envoy sent messages out of order), raised as :class:`LifecycleError`.
"""

from __future__ import annotations

from enum import Enum


class State(Enum):
    """Where a request is."""

    AWAIT_HEADERS = "await_headers"
    AWAIT_BODY = "await_body"
    ADMITTED = "admitted"
    PASSTHROUGH = "passthrough"
    RESPONDING = "responding"
    STREAMING = "streaming"
    CUT = "cut"
    DONE = "done"


class Input(Enum):
    """What happened."""

    REQUEST_HEADERS = "request_headers"
    REQUEST_BODY = "request_body"
    REFUSED = "refused"
    ADMITTED = "admitted"
    PASS = "pass"
    RESPONSE_HEADERS = "response_headers"
    STREAM_START = "stream_start"
    RESPONSE_BODY = "response_body"
    TRAILERS = "trailers"
    CUT = "cut"
    END = "end"


S, I = State, Input

TRANSITIONS: dict[tuple[State, Input], State] = {
    (S.AWAIT_HEADERS, I.REQUEST_HEADERS): S.AWAIT_BODY,
    (S.AWAIT_BODY, I.REQUEST_BODY): S.AWAIT_BODY,
    (S.AWAIT_BODY, I.ADMITTED): S.ADMITTED,
    (S.AWAIT_BODY, I.REFUSED): S.DONE,
    (S.AWAIT_BODY, I.PASS): S.PASSTHROUGH,
    # Envoy's own local reply (413, 503...) arrives without the body ever reaching us.
    (S.AWAIT_BODY, I.RESPONSE_HEADERS): S.RESPONDING,
    (S.ADMITTED, I.RESPONSE_HEADERS): S.RESPONDING,
    (S.PASSTHROUGH, I.RESPONSE_HEADERS): S.RESPONDING,
    (S.PASSTHROUGH, I.RESPONSE_BODY): S.PASSTHROUGH,
    (S.PASSTHROUGH, I.TRAILERS): S.PASSTHROUGH,
    (S.RESPONDING, I.STREAM_START): S.STREAMING,
    (S.RESPONDING, I.RESPONSE_BODY): S.RESPONDING,
    (S.RESPONDING, I.TRAILERS): S.RESPONDING,
    (S.RESPONDING, I.END): S.DONE,
    (S.STREAMING, I.RESPONSE_BODY): S.STREAMING,
    (S.STREAMING, I.TRAILERS): S.STREAMING,
    (S.STREAMING, I.CUT): S.CUT,
    (S.STREAMING, I.END): S.DONE,
    (S.CUT, I.RESPONSE_BODY): S.CUT,
    (S.CUT, I.TRAILERS): S.CUT,
    (S.CUT, I.END): S.CUT,
    (S.DONE, I.END): S.DONE,
    (S.DONE, I.RESPONSE_BODY): S.DONE,
    (S.DONE, I.TRAILERS): S.DONE,
}


class LifecycleError(RuntimeError):
    """An input that is not valid in the current state."""


class Lifecycle:
    """Holds the current state and applies inputs through :data:`TRANSITIONS`."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = State.AWAIT_HEADERS

    def advance(self, inp: Input) -> State:
        """Apply ``inp``; raise :class:`LifecycleError` when it is not allowed."""
        nxt = TRANSITIONS.get((self.state, inp))
        if nxt is None:
            raise LifecycleError(f"{inp.value} is not valid in state {self.state.value}")
        self.state = nxt
        return nxt
