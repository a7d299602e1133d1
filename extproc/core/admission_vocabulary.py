"""Admission's vocabulary: the events the server feeds
:class:`~extproc.core.admission_flow.Admission` (through the session) and the actions it returns.

Events: the body (or an ``rpm_only`` path) that starts it, then the answers to what it asked
(the exact input count; the limiter's answer to the admission call: answered, failed,
cancelled, or not made for the settlement backlog).  Actions: what the server does, in order;
:class:`CountExact` and :class:`CallAdmit` are always last: their answer is the next event.
Both sides import this module whole (``from extproc.core import admission_vocabulary as av``).
Sans-IO.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from extproc.core.keys import WindowedBucket
from extproc.core.phase_records import AdmitModel
from extproc.core.rules import Adjustment, BucketCharge
from extproc.core.waiting import QueueCall
from extproc.errors import GatewayError, LimiterUnavailable

# -- events: what the server saw ----------------------------------------------------------------


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
    """The exact input count :class:`~extproc.core.admission_vocabulary.CountExact` asked for."""

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
    """The request does not wait (asked once more, without a wait): ``why`` ``replica_full``,
    the replica holds its most waiters already; ``draining``, the replica is shutting down and
    the request's turn comes after its drain's grace (docs/operations.md, "Draining")."""

    why: str = "replica_full"


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
#: Admission's event types (the session routes these to the admission).
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

# -- actions: what the server does, in order ----------------------------------------------------
# Those every request makes are plain (not frozen) dataclasses: cheaper to build, and nothing
# changes them.


@dataclass(slots=True)
class CountExact:
    """Count the request's input exactly with ``model``'s tokenizer (a body of ``size`` bytes:
    a large one in a worker thread), then report
    :class:`~extproc.core.admission_vocabulary.InputCounted`."""

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
    :class:`TurnCame`; a replica already holding its most waiters, or draining with
    ``until_ms`` after its grace's end, reports :class:`WaitDeclined` instead (at once, or
    when the drain starts).  A client that hangs up meanwhile leaves the queue (``ticket``
    from ``queue``) at once."""

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
    ``queue_full``, ``replica_full``), or refused because its replica drains (``draining``,
    after waiting or at once): count it."""

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
