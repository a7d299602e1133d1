"""What a metered stream asks the server to do: the actions :class:`MeteredStream` returns.

The server executes them in order and computes nothing itself: bytes to forward (with the
final figures when ``output_tokens`` is set), a charge to start, a cut to render, a count to
take before the stream can go on, a wait on the charge in flight, and what to count and log.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.core.keys import WindowedBucket
from extproc.core.lifecycle import CutReason
from extproc.core.phase_records import AdmitModel
from extproc.core.rules import Adjustment, BucketCharge
from extproc.core.waiting import QueueCall
from extproc.errors import GatewayError, StreamCut


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


# -- admission: what :class:`~extproc.core.admission_flow.Admission` asks the server to do ---------
# The server executes them in order; :class:`CountExact` and :class:`CallAdmit` are always
# last: their answer is the next event (:mod:`extproc.core.events`).  Those every request
# makes are plain (not frozen) dataclasses: cheaper to build, and nothing changes them.


@dataclass(slots=True)
class CountExact:
    """Count the request's input exactly with ``model``'s tokenizer (a body of ``size`` bytes:
    a large one in a worker thread), then report
    :class:`~extproc.core.events.InputCounted`."""

    model: AdmitModel
    size: int


@dataclass(frozen=True, slots=True)
class DraftRecord:
    """The usage record's draft admission leaves in the request's ledger (written by the
    tenant's next admission if this processor dies)."""

    request_id: str
    tenant: str
    key: str
    model: str
    api: str
    input_tokens: int
    reserved_output: int
    admitted_at_ms: int


@dataclass(slots=True)
class CallAdmit:
    """Make the one admission call: ``charges`` on ``buckets`` (``tpm_charged`` tokens on each
    TPM counter), leased until ``lease_until_ms`` (0: not leased) with ``draft``; then report
    its answer (or that it failed, was cancelled or not made: the settlement backlog)."""

    buckets: tuple[WindowedBucket, ...]
    charges: list[BucketCharge]
    tpm_charged: int
    count_refused: bool
    ledger_ttl_ms: int
    now_ms: int = 0
    lease_until_ms: int = 0
    draft: DraftRecord | None = None
    #: the request may wait for its turn (docs/semantics.md, "Waiting")
    queue: QueueCall | None = None


@dataclass(frozen=True, slots=True)
class Wait:
    """The request holds a ticket in its tenant's queue: sleep until ``until_ms`` (unix ms),
    keeping Envoy's message timeout from firing, then report
    :class:`~extproc.core.events.TurnCame`; a replica already holding its most waiters reports
    :class:`~extproc.core.events.WaitDeclined` at once.  A client that hangs up meanwhile
    leaves the queue (``ticket`` from ``queue``) at once."""

    until_ms: int
    ticket: str
    queue: tuple[str, str, str]
    first: bool  # the request's first wait (a log line, the waiters gauge)


@dataclass(frozen=True, slots=True)
class LeaveQueue:
    """Take the request's ``ticket`` out of its tenant's ``queue`` (it will not wait)."""

    ticket: str
    queue: tuple[str, str, str]


@dataclass(frozen=True, slots=True)
class WaitOver:
    """The request's wait is over: ``outcome`` ``admitted`` or ``refused`` after waiting
    ``waited_ms``, or refused at once (``unservable``: its turn is beyond its maximum wait,
    ``queue_full``, ``replica_full``): count it."""

    outcome: str
    waited_ms: int


@dataclass(frozen=True, slots=True)
class KeepCancel:
    """Keep a cancel of an admission call that may have run (or may still run): ``undo`` once
    Redis answers if it ran, or stop it from ever running."""

    undo: list[Adjustment]
    ledger_ttl_ms: int


@dataclass(frozen=True, slots=True)
class KeepLeases:
    """A leased admission went through: keep open reservations' leases renewed."""


@dataclass(slots=True)
class Attempting:
    """Admission tries the request as ``model`` (log lines from here on carry it)."""

    tenant: str
    model: str


@dataclass(frozen=True, slots=True)
class InputAdmission:
    """How the input was admitted: on its ``bound``, ``recounted`` after a refused bound, or
    on its ``exact`` count (counted)."""

    how: str


@dataclass(slots=True)
class LimitDecisions:
    """Count each ``(metric, decision)``: refused, fallback, shadow_refused..."""

    decisions: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class ShadowRefused:
    """Shadow limits that would have refused the admission: log them."""

    limits: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class FellBack:
    """A refusal by a limit on the ``requested`` model is served by the plan's ``fallback``:
    log it."""

    requested: str
    fallback: str
    reason: str


@dataclass(frozen=True, slots=True)
class DuplicateAdmit:
    """The admission call was our own retried call, found done: count it."""


@dataclass(frozen=True, slots=True)
class AdmitError:
    """The admission call failed: count it; ``unmetered``: the request goes on unmetered
    (fail-open), log that."""

    unmetered: bool


@dataclass(frozen=True, slots=True)
class PushedBack:
    """The settlement backlog is full: count and log the push-back; ``unmetered``: the
    request goes on unmetered (fail-open), else it is refused."""

    unmetered: bool


@dataclass(slots=True)
class Decided:
    """The request is admitted (its record set): count it and log the decision line."""

    tenant: str
    key: str
    model: str
    api: str
    input_tokens: int
    input_counted: str
    reserved_output: int
    stream: bool
    decision: str
    mode: str
    streaming: str


@dataclass(slots=True)
class ForwardBody:
    """Admission is over: forward ``body`` upstream (None: as it came)."""

    body: bytes | None


@dataclass(frozen=True, slots=True)
class Reject:
    """Admission is over: answer the client with ``error`` (the API's own error rendering)."""

    error: GatewayError


AdmissionAction = (
    CountExact
    | CallAdmit
    | Wait
    | LeaveQueue
    | WaitOver
    | KeepCancel
    | KeepLeases
    | Attempting
    | InputAdmission
    | LimitDecisions
    | ShadowRefused
    | FellBack
    | DuplicateAdmit
    | AdmitError
    | PushedBack
    | Decided
    | ForwardBody
    | Reject
)
