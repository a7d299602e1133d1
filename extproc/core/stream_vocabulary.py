"""The metered stream's vocabulary: the events the server feeds
:class:`~extproc.core.streaming.MeteredStream` (through the session) and the actions it returns.

Events are plain records of what the server saw (a body chunk, trailers, the limiter's answer,
a wait that ran out, the input count that finished, a shutdown cut); actions are what the server
does, in order, computing nothing itself: bytes to forward (with the final figures when
``output_tokens`` is set), a charge to start, a cut to render, a count to take before the
stream can go on, a wait on the charge in flight, and what to count and log.  Both sides import
this module whole (``from extproc.core import stream_vocabulary as sv``).  Sans-IO.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from extproc.core.keys import WindowedBucket
from extproc.core.lifecycle import CutReason
from extproc.core.rules import BucketCharge
from extproc.errors import StreamCut

# -- events: what the server saw ----------------------------------------------------------------


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
    """The exact input count a figure needed is taken (see :class:`CountInput`): the stream
    resumes where it stopped."""


@dataclass(frozen=True, slots=True)
class CutNow:
    """The server ends the stream itself (shutdown); the input count is already taken."""

    reason: CutReason
    message: str | None = None


StreamEvent = (
    BodyChunk | Trailers | ChargeAnswered | ChargeFailed | ChargeAbandoned | CountDone | CutNow
)
#: The stream's event types (the session routes these to the stream).
STREAM_EVENTS: Final = frozenset(
    (BodyChunk, Trailers, ChargeAnswered, ChargeFailed, ChargeAbandoned, CountDone, CutNow)
)

# -- actions: what the server does, in order ----------------------------------------------------


@dataclass(slots=True)
class Forward:
    """Send ``data`` to the client (``end_stream`` on the response's last bytes); when
    ``output_tokens`` is set, the response carries the request's final figures with it."""

    data: bytes
    end_stream: bool = False
    output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class StartCharge:
    """Ask the limiter for ``amount`` output tokens on ``buckets`` (``charges``: what each
    counter takes; charge number ``seq``; ``strict``: a lease, granted only as far as the
    quota goes)."""

    seq: int
    buckets: tuple[WindowedBucket, ...]
    charges: list[BucketCharge]
    amount: int
    strict: bool


@dataclass(frozen=True, slots=True)
class AwaitCharge:
    """Events are held until the charge in flight answers: wait for it, then report it."""


@dataclass(frozen=True, slots=True)
class CountInput:
    """A figure is about to be decided and needs the exact input count (off the event loop for
    a large prompt): take it, then report :class:`~extproc.core.stream_vocabulary.CountDone`."""


@dataclass(frozen=True, slots=True)
class Cut:
    """End the stream with ``data`` (the API's error event), carrying the final figures
    (``output_tokens``), then abort the response with ``error``'s status."""

    reason: CutReason
    data: bytes
    error: StreamCut
    output_tokens: int
    delivered: int
    charged: int


@dataclass(frozen=True, slots=True)
class ShadowExceeded:
    """A shadow limit this stream took past its limit (once per limit): count and log it."""

    metric: str
    limit: str
    used: int


@dataclass(frozen=True, slots=True)
class ChargeError:
    """The limiter failed a charge: count it; ``unmetered``: the stream goes on unmetered
    (fail-open), log it."""

    unmetered: bool


@dataclass(frozen=True, slots=True)
class StalledWithoutCharge:
    """The stream waited on a charge that was never started: log it (it stops enforcing)."""


StreamAction = (
    Forward
    | StartCharge
    | AwaitCharge
    | CountInput
    | Cut
    | ShadowExceeded
    | ChargeError
    | StalledWithoutCharge
)
