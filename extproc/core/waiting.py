"""Waiting instead of an immediate 429: the queue rule, sans-IO (docs/semantics.md, "Waiting").

A plan with ``wait`` holds a request over a rate limit (RPM or TPM over a window shorter than
a day, or concurrency) until its turn, up to the plan's ``max_seconds``.  The order lives in
Redis, per tenant: a sorted set of tickets (one per waiting request, its ledger), scored by
arrival (stamped by Redis's own clock: one order for every replica) less its priority class
times the plan's ``priority_boost_seconds`` (a class-``c`` ticket queues as if it had come
``c`` boosts earlier: a lower class waits behind a higher one that came at most that much
later, never longer: the no-starvation bound), with a lease each (a dead processor's ticket
lapses) and the TPM tokens each will charge.

The rule, for one admission call of a request with ``ahead`` units of waiters before it on
each bucket (every ticket of the tenant for a newcomer; those scored before its own for a
ticket), in one atomic step (admit.lua mirrors :func:`decide`; the in-memory limiter calls it):

* **admit** when every bucket has room for everyone ahead *and* the request (room that
  waiters ahead are promised is theirs; a request never jumps the queue);
* **refuse at once** when a bucket that does not wait (a budget: money, weighted tokens, a day
  or longer window, distinct end users) has no room for the request, when the request alone
  exceeds a rate limit, or when its turn (:func:`turn_ms`) comes after its deadline (its
  arrival plus the plan's maximum wait): the 429 carries that turn as ``retry-after``;
* otherwise **wait** until its turn: the server sleeps until then and calls again (the same
  ledger: the call is idempotent).

Turns come from the window arithmetic, counting the waiters ahead as served first, one by one
in queue order, each at the first moment its window has room for it: on a fixed window the
first window with room (:func:`packed_turn`), on a sliding window the first millisecond, as the
limiter floors the previous window's share (:func:`sliding_turn`).  Exact when every request of
the tenant waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Final, Literal, Protocol

from extproc.core.keys import SLIDING_SCALE, WindowedBucket
from extproc.errors import QuotaExceeded

#: A rate bucket's kind, as the queue treats it.
WaitKind = Literal["none", "fixed", "sliding", "concurrency"]

#: How often a request waiting on a concurrency slot asks again (its turn cannot be computed:
#: it comes when a running request ends).
CONCURRENCY_POLL_MS: Final = 250
#: How long a ticket outlives its expected turn before it lapses (its processor died).
TICKET_LEASE_MS: Final = 3000
#: What a held request asks Envoy for on its message (``override_message_timeout``; Envoy takes
#: one per message): Envoy's ``max_message_timeout`` (``ai-quota envoy-config``) is at least
#: this, and the longest wait (``wait.max_seconds``, at most 50 s) fits in it with room for the
#: last admission call.
HOLD_TIMEOUT_MS: Final = 60_000
#: The request header that asks for a priority class (a plan's ``wait.max_priority`` caps it).
PRIORITY_HEADER: Final = "x-aiquota-priority"
#: The response header that tells how long an admitted request of a waiting plan waited.
WAITED_HEADER: Final = "x-ratelimit-waited-ms"
#: A turn never computed (a request alone over a rate limit).
NEVER: Final = -1


class Outcome(IntEnum):
    """What one admission call decided (admit.lua's status)."""

    REFUSED = 0
    ADMITTED = 1
    DUPLICATE = 2
    WAIT = 3


@dataclass(frozen=True, slots=True)
class QueueBucket:
    """One bucket of the request as the rule reads it.

    ``value`` is what the limiter judges (sliding: ``current`` + the previous window's share);
    ``previous`` the previous window's whole counter (sliding only); ``ahead`` the units the
    waiters before this request will take from it."""

    kind: WaitKind
    value: int
    amount: int
    limit: int
    ahead: int = 0
    #: the waiters ahead one by one, in queue order (a fixed window's turn packs them in
    #: order; empty: ``ahead`` is taken as that many units of 1, a request count)
    sizes: tuple[int, ...] = ()
    window_end_ms: int = 0
    window_ms: int = 0
    current: int = 0
    previous: int = 0
    shadow: bool = False

    def room(self) -> bool:
        """Room for everyone ahead and the request (a bucket that does not wait: for the
        request)."""
        if self.shadow or self.amount <= 0:
            return True
        ahead = self.ahead if self.kind != "none" else 0
        return self.value + ahead + self.amount <= self.limit


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def turn_ms(b: QueueBucket, now_ms: int) -> int:
    """When ``b`` has room for everyone ahead and the request, by the window arithmetic
    (``now_ms`` when it has room now; :data:`NEVER` when the request alone exceeds the limit;
    a concurrency bucket's turn is unknown: ``now_ms`` + :data:`CONCURRENCY_POLL_MS`).

    Fixed window: the waiters ahead and then the request are packed into this window and the
    next ones in queue order, each in the first window whose room takes it after the ones
    before it (a request count: ``limit`` per window).  Sliding window: within this window,
    room grows as the previous window's share shrinks; beyond it the queue drains at ``limit``
    per window length (a fluid count)."""
    if b.room():
        return now_ms
    if b.amount > b.limit:
        return NEVER
    if b.kind == "concurrency":
        return now_ms + CONCURRENCY_POLL_MS
    need = b.ahead + b.amount
    limit, end, length = b.limit, b.window_end_ms, max(1, b.window_ms)
    if b.kind == "fixed" and b.sizes:
        return max(now_ms, packed_turn(b.value, (*b.sizes, b.amount), limit, end, length))
    if b.kind == "fixed":
        spill = need - max(0, limit - b.value)
        return max(now_ms, end + (_ceil_div(spill, limit) - 1) * length)
    sizes = b.sizes or (1,) * b.ahead
    return sliding_turn((*sizes, b.amount), b.current, b.previous, limit, end, length, now_ms)


def sliding_turn(  # noqa: PLR0917 - a sliding bucket's whole state
    sizes: Sequence[int],
    current: int,
    previous: int,
    limit: int,
    end: int,
    length: int,
    now_ms: int,
) -> int:
    """When the last of ``sizes`` is admitted on a sliding window, each in queue order at the
    first millisecond (not before the one before it) its window has room for it: the window's
    own count (``current``, ending at ``end``) plus the previous window's count (``previous``)
    weighted as the limiter weighs it (its share of the window still to come, in parts per
    million, floored, then the product floored), plus the request, within ``limit``; a window
    after this one starts with this one's count as its previous."""
    t, start = now_ms, end - length
    for n in sizes:
        while True:
            room = limit - current - n
            if room >= 0:
                at = start
                if previous > room:  # the previous window's share must fall to ``room``
                    w = _ceil_div((room + 1) * SLIDING_SCALE, previous) - 1
                    at = end - _ceil_div((w + 1) * length, SLIDING_SCALE) + 1
                t = max(t, at)
                if t < end:
                    current += n
                    break
            previous, current, start, end = current, 0, end, end + length
            t = max(t, start)
    return t


def packed_turn(value: int, sizes: Sequence[int], limit: int, end: int, length: int) -> int:
    """The start of the fixed window the last of ``sizes`` lands in when they are packed in
    order from this window (``value`` used, ending at ``end``) on, each in the first window
    with room for it after the ones before it (a window after this one starts empty)."""
    used, windows = value, 0
    for n in sizes:
        if used + n > limit:
            windows, used = windows + 1, 0
        used += n
    return end + (windows - 1) * length if windows else 0


@dataclass(frozen=True, slots=True)
class Decision:
    """The rule's answer: the outcome, the turn (ms; 0 when admitted, :data:`NEVER` when no
    turn can come) and whether a bucket that does not wait refused."""

    outcome: Outcome
    turn_ms: int = 0
    budget: bool = False


def decide(
    buckets: list[QueueBucket],
    now_ms: int,
    deadline_ms: int,
    *,
    queued: int = 0,
    cap: int = 0,
    ticketed: bool = False,
) -> Decision:
    """Admit, wait or refuse (see the module's docstring).  ``queued``: live tickets of the
    tenant; ``cap``: the most it may hold (a newcomer beyond it is refused; 0: no cap);
    ``ticketed``: the request holds a ticket already."""
    if all(b.room() for b in buckets):
        return Decision(Outcome.ADMITTED)
    turn = now_ms
    budget = False
    for b in buckets:
        if b.room():
            continue
        if b.kind == "none":
            budget = True
            continue
        t = turn_ms(b, now_ms)
        if t == NEVER:
            return Decision(Outcome.REFUSED, NEVER)
        turn = max(turn, t)
    if budget:
        return Decision(Outcome.REFUSED, 0, budget=True)
    if turn > deadline_ms:
        if any(b.kind == "concurrency" and not b.room() for b in buckets) and now_ms < deadline_ms:
            # a slot may free up any time: one more look at the deadline, if the rates allow
            rates = [turn_ms(b, now_ms) for b in buckets if b.kind in ("fixed", "sliding")]
            if max(rates, default=now_ms) <= deadline_ms:
                return Decision(Outcome.WAIT, deadline_ms)
        return Decision(Outcome.REFUSED, turn)
    if not ticketed and cap > 0 and queued >= cap:
        return Decision(Outcome.REFUSED, turn)
    return Decision(Outcome.WAIT, turn)


def wait_kind(metric: str, window_s: int, *, sliding: bool, period: str | None) -> WaitKind:
    """How the queue treats a limit: RPM and TPM over a window shorter than a day wait (fixed
    or sliding), concurrency waits on a slot; budgets (money, weighted tokens, a day or longer,
    calendar periods) and distinct end users do not."""
    if metric == "concurrency":
        return "concurrency"
    if metric in ("rpm", "tpm") and period is None and 0 < window_s < 86_400:
        return "sliding" if sliding else "fixed"
    return "none"


def priority_offset_ms(priority: int, boost_ms: int) -> int:
    """How much earlier than its arrival a ticket of class ``priority`` queues."""
    return priority * boost_ms


#: A bucket's wait kind as admit.lua reads it.
KIND_CODES: Final[dict[WaitKind, int]] = {"none": 0, "fixed": 1, "sliding": 2, "concurrency": 3}


@dataclass(frozen=True, slots=True)
class QueueCall:
    """The queue part of one admission call (admit.lua's queue section): the tenant's queue
    keys (tickets, their leases, their tokens), the ticket's priority offset (a new ticket is
    scored by its arrival, stamped by Redis's clock, less this), the request's deadline
    (unix ms), how long a ticket outlives its turn, the tenant's cap of tickets (0: none), and
    per bucket (the call's order) its wait kind, window end and window length (ms)."""

    keys: tuple[str, str, str]
    offset_ms: int
    deadline_ms: int
    buckets: tuple[tuple[WaitKind, int, int], ...]
    lease_ms: int = TICKET_LEASE_MS
    cap: int = 0
    poll_ms: int = CONCURRENCY_POLL_MS


def queue_keys(tag: str, slot: str) -> tuple[str, str, str]:
    """A tenant's queue keys under its hash tag ``tag`` (:func:`extproc.core.keys.tenant_tag`):
    the tickets, their leases, their tokens."""
    base = f"{tag}:wait:{slot}"
    return f"{base}:q", f"{base}:lease", f"{base}:tokens"


@dataclass(frozen=True, slots=True)
class WaitRule:
    """A plan's ``wait``: the longest wait (ms), the tenant's cap of tickets, the plan's
    priority class and the highest one the request header may ask for, and the boost (ms)
    one class is worth."""

    max_ms: int
    max_waiters: int = 100
    priority: int = 0
    max_priority: int = 0
    boost_ms: int = 5000

    def priority_for(self, asked: str | None) -> int:
        """The request's class: the header's (a digit up to :attr:`max_priority`) when the
        plan allows one, else the plan's."""
        if asked is not None and self.max_priority > 0:
            a = asked.strip()
            if a.isdigit() and len(a) == 1:
                return min(int(a), self.max_priority)
        return self.priority


def bucket_kinds(
    buckets: Sequence[WindowedBucket],
) -> tuple[tuple[WaitKind, int, int], ...]:
    """Each bucket's wait kind, window end and window length (ms), for a :class:`QueueCall`."""
    return tuple(
        (
            wait_kind(b.metric, b.limit.window_s, sliding=b.limit.sliding, period=b.limit.period),
            b.window_end_ms,
            b.limit.window_s * 1000,
        )
        for b in buckets
    )


def wait_refusal(
    err: QuotaExceeded, res: WaitAnswer, now_ms: int, *, declined: str, waited_ms: int
) -> QuotaExceeded:
    """A waiting request's 429: its ``retry-after`` is the turn it would have needed (when one
    was computed), and the message says why it does not wait (``declined``: why its replica
    declined its wait, :class:`~extproc.core.admission_vocabulary.WaitDeclined`; "": it did
    not)."""
    err.headers = replace(err.headers, waited_ms=max(0, waited_ms))
    turn = res.turn_ms
    if turn > now_ms:
        err.retry_after_s = (turn - now_ms) / 1000.0
    if declined == "draining":
        why = "this gateway replica is shutting down before its turn; retry then"
    elif declined:
        why = "this gateway replica holds its most waiting requests"
    elif res.queue_full:
        why = "the tenant's queue of waiting requests is full"
    elif turn == NEVER:
        why = "the request alone exceeds the limit"
    elif turn > now_ms:
        why = (
            f"its turn would come in {(turn - now_ms) / 1000.0:.3f}s, beyond the plan's "
            "maximum wait"
        )
    else:
        why = "its maximum wait is over"
    waited = f" after waiting {waited_ms / 1000.0:.3f}s" if waited_ms > 0 else ""
    err.message = f"{err.message} Not queued{waited}: {why}."
    return err


class WaitAnswer(Protocol):
    """What a refusal reads of the limiter's answer to a waiting request's call."""

    @property
    def turn_ms(self) -> int: ...
    @property
    def queue_full(self) -> bool: ...
