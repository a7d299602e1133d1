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
    PASS = "pass"  # noqa: S105 - not a password
    RESPONSE_HEADERS = "response_headers"
    STREAM_START = "stream_start"
    RESPONSE_BODY = "response_body"
    TRAILERS = "trailers"
    CUT = "cut"
    END = "end"


S, In = State, Input

TRANSITIONS: dict[tuple[State, Input], State] = {
    (S.AWAIT_HEADERS, In.REQUEST_HEADERS): S.AWAIT_BODY,
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
    (S.RESPONDING, In.STREAM_START): S.STREAMING,
    (S.RESPONDING, In.RESPONSE_BODY): S.RESPONDING,
    (S.RESPONDING, In.TRAILERS): S.RESPONDING,
    (S.RESPONDING, In.END): S.DONE,
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
