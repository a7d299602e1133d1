"""The admission machine's transition table (extproc.core.admission_flow.TRANSITIONS), over any
order of events, those it waits for and those it does not (answers out of turn, duplicates,
late answers after the end, cancels, a second start): a pair the table lists moves to one of
the states it allows, a pair it does not list is a PhaseError that moves nothing; the state
always says what is out (the exact count, the call, nothing), a cancel keeps the call's undo
when a call is out and only then, and the admission ends once."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core import admission_flow
from extproc.core.admission_flow import TRANSITIONS, Admission, AdmissionState
from extproc.core.admission_vocabulary import (
    AdmissionAction,
    AdmissionEvent,
    AdmitAnswered,
    AdmitBacklogged,
    AdmitCancelled,
    AdmitFailed,
    BodyArrived,
    CallAdmit,
    CountExact,
    ForwardBody,
    InputCounted,
    KeepCancel,
    Reject,
    RpmOnlyArrived,
)
from extproc.core.phase_records import PhaseError
from extproc.errors import LimiterUnavailable
from tests.table_support import reachable
from tests.unit.test_core_admission_flow import (
    BODY,
    EXACT,
    admission_of,
    answer_event,
    config,
    session,
)

pytestmark = pytest.mark.unit

S = AdmissionState
#: The states with an admission call out.
CALL_OUT = (S.AWAITING_ADMISSION, S.AWAITING_BOUND_ADMISSION, S.AWAITING_RPM_ADMISSION)
ANSWERS = ("admitted", "refused_model", "refused_tenant", "duplicate", "failed", "timed_out")
KINDS = ("body", "rpm_only", "counted", "cancelled", "backlogged", *ANSWERS)
#: "next": what the admission waits for (the body, the count, an answer), drawn often so
#: that the orders reach every state (a fallback's attempt too), not only the first steps.
DRAWN = ("next",) * 8 + KINDS
#: One event of an order: what is drawn, and the answer "next" gives when a call is out.
order_st = st.lists(
    st.tuples(st.sampled_from(DRAWN), st.sampled_from((*ANSWERS, "cancelled", "backlogged"))),
    max_size=14,
)


def expected(state: AdmissionState, answer: str) -> str:
    """The kind of event ``state`` waits for (``answer`` when a call is out)."""
    if state is S.READY:
        return "rpm_only" if answer == "backlogged" else "body"
    if state is S.AWAITING_COUNT:
        return "cancelled" if answer == "cancelled" else "counted"
    return answer


def event(kind: str, call: CallAdmit | None) -> AdmissionEvent:
    """The event ``kind`` (an answer fits ``call``, the last call made, when there is one)."""
    if kind == "body":
        return BodyArrived(BODY)
    if kind == "rpm_only":
        return RpmOnlyArrived()
    if kind == "counted":
        return InputCounted(EXACT)
    if kind == "cancelled":
        return AdmitCancelled()
    if kind == "backlogged":
        return AdmitBacklogged()
    if call is None:  # an answer before any call: out of turn whatever it says
        if kind in ("failed", "timed_out"):
            return AdmitFailed(LimiterUnavailable("down", maybe_ran=kind == "timed_out"))
        return AdmitAnswered(kind != "refused_model", kind == "duplicate", ())
    return answer_event(call, kind)


def waits_for(state: AdmissionState) -> type | None:
    """What a step that leaves the admission in ``state`` asks for last."""
    if state is S.AWAITING_COUNT:
        return CountExact
    if state in CALL_OUT:
        return CallAdmit
    return None


@settings(max_examples=400, deadline=None)
@given(
    order=order_st,
    fallback=st.booleans(),
    fail_open=st.booleans(),
    on_bound=st.booleans(),
    room=st.booleans(),
    count=st.booleans(),
)
def test_any_order_of_events_moves_admission_by_its_table_only(
    order: list[tuple[str, str]],
    fallback: bool,
    fail_open: bool,
    on_bound: bool,
    room: bool,
    count: bool,
) -> None:
    cfg = config(fallback=fallback, fail_open=fail_open, on_bound=on_bound, count=count)
    adm = admission_of(cfg, session(cfg), room=room)
    call: CallAdmit | None = None  # the call out (or the last one made)
    ends = 0
    for drawn, answer in order:
        kind = expected(adm.state, answer) if drawn == "next" else drawn
        ev = event(kind, call)
        before = adm.state
        entry = TRANSITIONS.get((before, type(ev)))
        if entry is None:
            with pytest.raises(PhaseError):
                adm.handle(ev)
            assert adm.state is before  # refused: nothing moved
            continue
        out = adm.handle(ev)
        after = adm.state
        assert after in entry[1], f"{before} + {kind} -> {after}: not in the table"
        # only the last action asks for an answer, and it is the one the state waits for
        asks = [a for a in out if isinstance(a, CountExact | CallAdmit)]
        wanted = waits_for(after)
        if wanted is None:
            assert not asks
        else:
            assert asks == [out[-1]] and isinstance(out[-1], wanted)
        if isinstance(out[-1] if out else None, CallAdmit):
            call = out[-1]  # type: ignore[assignment]
        # a cancel keeps the call's undo exactly when a call was out
        kept = [a for a in out if isinstance(a, KeepCancel)]
        if isinstance(ev, AdmitCancelled):
            assert after is S.DONE and out == kept
            assert len(kept) == (1 if before in CALL_OUT else 0)
            if kept:
                assert call is not None
                assert [(u.key, -u.amount) for u in kept[0].undo] == [
                    (c.key, c.amount) for c in call.charges if c.kind != "concurrency" and c.amount
                ]
        elif isinstance(ev, AdmitFailed):
            assert len(kept) == (1 if ev.error.maybe_ran else 0)
        else:
            assert not kept
        # the admission ends once: forwarded or rejected (or cancelled, or an rpm_only pass)
        ends += sum(isinstance(a, ForwardBody | Reject) for a in out)
        assert not any(isinstance(a, ForwardBody | Reject) for a in out[:-1])  # last, if any
        if after is not S.DONE:
            assert not isinstance(out[-1], ForwardBody | Reject)
    assert ends <= 1
    if adm.state is S.DONE:  # late and duplicate answers, a second start: all refused
        for kind in KINDS:
            with pytest.raises(PhaseError):
                adm.handle(event(kind, call))
            assert adm.state is S.DONE


def state_of(adm: Admission) -> AdmissionState:
    """The admission's state, read afresh (not narrowed by an earlier check)."""
    return adm.state


def test_the_table_is_closed() -> None:
    """Every state is reached from READY; every state but DONE takes something (a wait can
    end: each waiting state takes its answer and a cancel); DONE takes nothing; every step
    may end the admission (a client error, a refusal)."""
    assert reachable(TRANSITIONS, S.READY) == set(S)
    takes: dict[AdmissionState, set[type]] = {}
    for (state, ev), (_, allowed) in TRANSITIONS.items():
        takes.setdefault(state, set()).add(ev)
        assert S.DONE in allowed
    assert S.DONE not in takes
    assert takes[S.READY] == {BodyArrived, RpmOnlyArrived}
    assert takes[S.AWAITING_COUNT] == {InputCounted, AdmitCancelled}
    for state in CALL_OUT:
        assert takes[state] == {AdmitAnswered, AdmitFailed, AdmitBacklogged, AdmitCancelled}


def test_a_step_may_not_lead_where_the_table_does_not_allow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The table is the rule: a step that returns a state its entry does not list is a
    PhaseError and the admission does not move."""

    def astray(adm: Admission, ev: Any, out: list[AdmissionAction]) -> AdmissionState:
        return S.AWAITING_RPM_ADMISSION

    key = (S.READY, BodyArrived)
    monkeypatch.setitem(admission_flow.TRANSITIONS, key, (astray, TRANSITIONS[key][1]))
    cfg = config()
    adm = admission_of(cfg, session(cfg))
    with pytest.raises(PhaseError, match="may not move"):
        adm.handle(BodyArrived(BODY))
    assert adm.state is S.READY


def test_an_answer_after_a_cancel_is_refused() -> None:
    """Cancelled while the call is out: the cancel is kept once; the call's answer, arriving
    late, and a second cancel are protocol errors, not a second admission."""
    cfg = config()
    adm = admission_of(cfg, session(cfg))
    call = adm.body(BODY)[-1]
    assert isinstance(call, CallAdmit) and adm.state is S.AWAITING_BOUND_ADMISSION
    out = adm.handle(AdmitCancelled())
    assert len(out) == 1 and isinstance(out[0], KeepCancel) and state_of(adm) is S.DONE
    for late in (answer_event(call, "admitted"), AdmitCancelled()):
        with pytest.raises(PhaseError):
            adm.handle(late)


def test_a_cancel_while_counting_keeps_nothing() -> None:
    """The request went away during the exact count: no call was made, nothing to undo."""
    cfg = config()
    adm = admission_of(cfg, session(cfg), room=False)
    assert isinstance(adm.body(BODY)[-1], CountExact) and adm.state is S.AWAITING_COUNT
    assert adm.handle(AdmitCancelled()) == [] and state_of(adm) is S.DONE
    with pytest.raises(PhaseError):
        adm.handle(InputCounted(EXACT))  # the count finishing late
