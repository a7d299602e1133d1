"""The core's rules for a prompt admitted on an upper bound, after admission
(extproc.core.bound_count): which request is counted at once, which is noted a moment later,
and that no note is written once settlement began or when it would refund nothing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.admission_plan import Cost
from extproc.core.bound_count import (
    NOTE_AFTER_S,
    CountForNote,
    CountInput,
    ScheduleNote,
    WriteNote,
    after_admission,
    after_count,
    count_at_response,
    count_before_figures,
    note,
    note_due,
)
from extproc.core.keys import windowed
from extproc.core.policies import bound_excess_refund
from extproc.core.rules import Limit

pytestmark = pytest.mark.unit

TPM = Limit("tpm", 100_000, 60, "*", "tenant")
RPM = Limit("rpm", 60, 60, "*", "tenant")
BUCKETS = tuple(windowed("aq", "t", "k", [TPM, RPM], 0))


def bound_cost(n: int) -> Cost:
    return Cost(
        input_tokens=n,
        effective_max_output=100,
        reserved_output=100,
        meter_stream=True,
        enforce_stream=True,
        strict=False,
        settle_to_actual=True,
        every=16,
    )


def test_an_audited_request_is_counted_at_once_and_noted_after_its_count() -> None:
    """The audit counts in the background and notes the count a moment later; any other
    request is only noted, and only if still open after NOTE_AFTER_S (a short request is never
    counted)."""
    assert after_admission(audit=True) == (CountInput(note_after_s=NOTE_AFTER_S),)
    assert after_admission(audit=False) == (ScheduleNote(NOTE_AFTER_S, None),)
    assert after_count(40, note_after_s=NOTE_AFTER_S, settling=False) == (
        ScheduleNote(NOTE_AFTER_S, 40),
    )


@given(exact=st.none() | st.integers(0, 10_000), settling=st.booleans(), asked=st.booleans())
def test_a_count_schedules_a_note_only_when_asked_counted_and_open(
    exact: int | None, settling: bool, asked: bool
) -> None:
    got = after_count(exact, note_after_s=NOTE_AFTER_S if asked else None, settling=settling)
    if asked and exact is not None and not settling:
        assert got == (ScheduleNote(NOTE_AFTER_S, exact),)
    else:
        assert got == ()


@given(
    bound=st.integers(1, 20_000),
    exact=st.none() | st.integers(0, 30_000),
    settling=st.booleans(),
)
def test_a_note_refunds_what_admission_charged_beyond_the_count_and_never_after_settling(
    bound: int, exact: int | None, settling: bool
) -> None:
    """When the timer expires: nothing once settlement began; a count first when none was
    taken; else a note of the count, only when it is below the bound, carrying the refund."""
    cost = bound_cost(bound)
    got = note_due("L", BUCKETS, cost, exact, settling=settling)
    if settling:
        assert got == ()
    elif exact is None:
        assert got == (CountForNote(),)
    elif exact >= bound:
        assert got == ()
    else:
        assert got == (WriteNote("L", exact, bound_excess_refund(BUCKETS, cost, exact)),)
        refund = dict(got[0].refund)
        assert all(units >= 0 for units in refund.values())
        assert set(refund) == {b.key for b in BUCKETS if b.kind == "tpm"}
    if exact is not None:
        assert note("L", BUCKETS, cost, exact, settling=True) is None


@given(pending=st.booleans(), counting=st.booleans(), ok=st.booleans(), needs=st.booleans())
def test_a_figure_waits_for_the_count_it_needs(
    pending: bool, counting: bool, ok: bool, needs: bool
) -> None:
    """A response counts at once only for a bound still pending, with no count running, whose
    upstream figure may not stand uncounted; a figure counts first when it needs the count or
    may not bill the upstream's uncounted."""
    assert count_at_response(pending=pending, counting=counting, may_bill_uncounted=ok) == (
        pending and not counting and not ok
    )
    assert count_before_figures(needs_count=needs, pending=pending, may_bill_uncounted=ok) == (
        needs or (pending and not ok)
    )
