"""After admission on an upper bound of the input: when the prompt's exact count is taken and
when it is noted in the request's open ledger.  Sans-IO rules that answer with actions; the
server executes them (the count in a worker thread for a large prompt, the timer, the note's
Redis call) and reports back.

* At admission (:func:`after_admission`): a request the input audit picks (one in
  ``requests.input_audit_every``, or every request of a model whose figures a count
  contradicted) is counted at once in the background, to check the upstream's figure against
  it, and the count noted a moment later; any other is only noted, and only if it is still open
  :data:`NOTE_AFTER_S` after its admission (a short request settles first and is never
  counted: the CPU the bound saves).
* A note (:func:`note_due`, :func:`note`) writes the exact count into the open ledger, so that a
  reclaim after a SIGKILL refunds the bound down to it; nothing is noted once settlement began
  (it bills the exact input itself) nor when the count is not below the bound.
* A response to meter whose upstream input figure may not be billed without a count (the
  model's room between counts is used up) is counted at once, off the answer's path
  (:func:`count_at_response`); a figure that needs the count waits for it
  (:func:`count_before_figures`).
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.core.admission_plan import Cost
from extproc.core.keys import WindowedBucket
from extproc.core.policies import bound_excess_refund

#: A request admitted on a bound of its input (not audited) that is still open this many
#: seconds after its admission is counted, and the count noted in its ledger, so that a
#: SIGKILL bills its exact input.  Shorter requests settle first and are never counted (the
#: CPU the bound saves); one SIGKILLed sooner keeps its bound (docs/semantics.md).
NOTE_AFTER_S = 0.25


@dataclass(frozen=True, slots=True)
class CountInput:
    """Count the prompt exactly in the background (a large one in a worker thread); with
    ``note_after_s``: once counted, schedule its note that long after."""

    note_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class ScheduleNote:
    """In ``after_s`` seconds, report that the note is due (:func:`note_due`); ``exact``: the
    count already taken (None: the note counts first)."""

    after_s: float
    exact: int | None = None


@dataclass(frozen=True, slots=True)
class CountForNote:
    """Count the prompt in the background for its note, then note it (:func:`note`)."""


@dataclass(frozen=True, slots=True)
class WriteNote:
    """Write ``exact`` into the request's open ledger: what admission charged each per-token
    counter beyond it (``refund``) becomes refundable by a reclaim."""

    ledger: str
    exact: int
    refund: tuple[tuple[str, int], ...]


BoundAction = CountInput | ScheduleNote | CountForNote | WriteNote

_AUDIT = (CountInput(note_after_s=NOTE_AFTER_S),)
_NOTE_LATER = (ScheduleNote(NOTE_AFTER_S),)


def after_admission(*, audit: bool) -> tuple[BoundAction, ...]:
    """Admitted on a bound (metered): counted at once when the audit picks it (then noted),
    else a note scheduled for a request still open a moment later."""
    return _AUDIT if audit else _NOTE_LATER


def after_count(
    exact: int | None, *, note_after_s: float | None, settling: bool
) -> tuple[BoundAction, ...]:
    """A background count finished (None: it could not: the bound stands): its note, when one
    was asked and the request is still open."""
    if note_after_s is None or exact is None or settling:
        return ()
    return (ScheduleNote(note_after_s, exact),)


def note(
    ledger: str,
    buckets: tuple[WindowedBucket, ...],
    bound: Cost,
    exact: int,
    *,
    settling: bool,
) -> WriteNote | None:
    """The note of ``exact`` for a request admitted on ``bound``: none once settlement is on
    its way (it bills the exact input), nor when there is nothing to refund."""
    if settling or exact >= bound.input_tokens:
        return None
    return WriteNote(ledger, exact, bound_excess_refund(buckets, bound, exact))


def note_due(
    ledger: str,
    buckets: tuple[WindowedBucket, ...],
    bound: Cost,
    exact: int | None,
    *,
    settling: bool,
) -> tuple[BoundAction, ...]:
    """The note's timer expired: nothing once settlement began, else count first (unless
    counted) and note."""
    if settling:
        return ()
    if exact is None:
        return (CountForNote(),)
    write = note(ledger, buckets, bound, exact, settling=settling)
    return () if write is None else (write,)


def count_at_response(*, pending: bool, counting: bool, may_bill_uncounted: bool) -> bool:
    """A response to meter: count now (in the background) when the input is still the bound,
    no count runs, and the upstream's figure may not be billed without one."""
    return pending and not counting and not may_bill_uncounted


def count_before_figures(*, needs_count: bool, pending: bool, may_bill_uncounted: bool) -> bool:
    """Before a figure is decided (settlement, a cut's message, the access log's input): count
    when the figure needs the count, or when the upstream's may not be billed without one."""
    return needs_count or (pending and not may_bill_uncounted)
