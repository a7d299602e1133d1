"""What happens to a metered stream: the events the server feeds its :class:`MeteredStream`.

Each is a plain record of something the server saw (a body chunk, trailers, the limiter's
answer, a clock that ran out, the input count that finished); the stream decides what follows
(:mod:`extproc.core.actions`).  Sans-IO: nothing here reads a socket or a clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.core.lifecycle import CutReason
from extproc.errors import LimiterUnavailable


@dataclass(slots=True)
class BodyChunk:
    """One upstream body chunk, as it arrived (still compressed when the upstream compressed
    it); ``end`` on the last; ``answer``: the charge's answer that came in since the chunk
    before (it applies first)."""

    data: bytes
    end: bool
    answer: ChargeAnswered | ChargeFailed | None = None


@dataclass(frozen=True, slots=True)
class Trailers:
    """The upstream's trailers: the stream's end without a last body chunk."""


@dataclass(frozen=True, slots=True)
class ChargeAnswered:
    """The limiter answered the last charge: ``granted`` tokens, whether a bucket is
    ``exhausted``, and each bucket's value after it (in the charge's bucket order).

    ``late``: settlement collected the answer; only its bookkeeping applies (the response is
    over: nothing more is forwarded)."""

    granted: int
    exhausted: bool
    values: tuple[int, ...]
    late: bool = False


@dataclass(frozen=True, slots=True)
class ChargeFailed:
    """The limiter could not answer the last charge; ``maybe_ran``: it may still run once
    Redis answers.  ``late`` as in :class:`ChargeAnswered`."""

    maybe_ran: bool
    late: bool = False


@dataclass(frozen=True, slots=True)
class ChargeAbandoned:
    """Settlement stopped waiting for the charge in flight (its answer never came in time)."""


@dataclass(frozen=True, slots=True)
class CountDone:
    """The exact input count a figure needed is taken (see :class:`~extproc.core.actions.
    CountInput`): the stream resumes where it stopped."""


@dataclass(frozen=True, slots=True)
class CutNow:
    """The server ends the stream itself (shutdown); the input count is already taken."""

    reason: CutReason
    message: str | None = None


StreamEvent = (
    BodyChunk | Trailers | ChargeAnswered | ChargeFailed | ChargeAbandoned | CountDone | CutNow
)


# -- admission: what the server saw while :class:`~extproc.core.admission_flow.Admission` waited ----


@dataclass(frozen=True, slots=True)
class BodyArrived:
    """The request body arrived (``raw``, as the client sent it): admission starts."""

    raw: bytes


@dataclass(frozen=True, slots=True)
class RpmOnlyArrived:
    """An unmetered path under ``paths.other: rpm_only`` reached the body phase: admission
    starts, one request on the RPM buckets."""


@dataclass(frozen=True, slots=True)
class InputCounted:
    """The exact input count :class:`~extproc.core.actions.CountExact` asked for."""

    tokens: int


@dataclass(slots=True)
class AdmitAnswered:
    """The limiter answered the admission call: ``admitted``, ``duplicate`` (our own retried
    call found it done) and each bucket's value (after charging when admitted).  (Not
    frozen: every request makes one.)"""

    admitted: bool
    duplicate: bool
    values: tuple[int, ...]
    #: a waiting request: it holds a ticket until ``turn_ms`` (``wait``); refused, the turn it
    #: would have needed (0: none, -1: never) and whether its tenant's queue was full
    wait: bool = False
    turn_ms: int = 0
    queue_full: bool = False


@dataclass(frozen=True, slots=True)
class AdmitFailed:
    """The limiter could not answer the admission call (``error.maybe_ran``: it may still run
    once Redis answers)."""

    error: LimiterUnavailable


@dataclass(frozen=True, slots=True)
class AdmitCancelled:
    """The request went away while its admission call was out (the call may run all the
    same)."""


@dataclass(frozen=True, slots=True)
class AdmitBacklogged:
    """The call was not made: the settlements waiting for Redis reached their backlog."""


@dataclass(frozen=True, slots=True)
class TurnCame:
    """The request's expected turn came (the server slept until it): ask again."""


@dataclass(frozen=True, slots=True)
class WaitDeclined:
    """The replica holds its most waiters already: the request does not wait."""


AdmissionEvent = (
    BodyArrived
    | RpmOnlyArrived
    | InputCounted
    | AdmitAnswered
    | AdmitFailed
    | AdmitCancelled
    | AdmitBacklogged
    | TurnCame
    | WaitDeclined
)
