"""What a metered stream asks the server to do: the actions :class:`MeteredStream` returns.

The server executes them in order and computes nothing itself: bytes to forward (with the
final figures when ``output_tokens`` is set), a charge to start, a cut to render, a count to
take before the stream can go on, a wait on the charge in flight, and what to count and log.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.core.keys import WindowedBucket
from extproc.core.lifecycle import CutReason
from extproc.core.rules import BucketCharge
from extproc.errors import StreamCut


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
    a large prompt): take it, then report :class:`~extproc.core.events.CountDone`."""


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
