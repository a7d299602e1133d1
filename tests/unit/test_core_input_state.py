"""Where a request's input figure stands (extproc.core.input_state), over any order of events:
it moves by its table only, an illegal move (a second count, a count of an exact input) is a
PhaseError that changes nothing, and the flags read off it never contradict each other."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.input_state import (
    COUNTED_AFTER_BOUND,
    INPUT_TRANSITIONS,
    PENDING,
    UNCOUNTED,
    InputEvent,
    InputState,
    move,
)
from extproc.core.phase_records import PhaseError

pytestmark = pytest.mark.unit


@given(events=st.lists(st.sampled_from(list(InputEvent)), max_size=12))
def test_any_order_of_events_moves_the_input_by_its_table_only(
    events: list[InputEvent],
) -> None:
    state = InputState.EXACT
    counts = 0
    for ev in events:
        expected = INPUT_TRANSITIONS.get((state, ev))
        if expected is None:
            with pytest.raises(PhaseError):
                move(state, ev)
            continue  # refused: nothing changed
        if ev in (InputEvent.COUNTED, InputEvent.COUNT_FAILED, InputEvent.ADOPTED):
            counts += 1
        state = move(state, ev)
        assert state is expected
        # pending, and counted after the bound, never both; uncounted is never counted
        assert not (state in PENDING and state in COUNTED_AFTER_BOUND)
        assert not (state in UNCOUNTED and state in (InputState.COUNTED, InputState.KEPT_BOUND))
    assert counts <= 1, "a bound is replaced by a count once"
    if state is InputState.EXACT:
        assert counts == 0  # nothing counts an input that was exact at admission


def test_only_a_bound_can_be_counted_and_a_count_comes_once() -> None:
    """A duplicate or late count is refused."""
    with pytest.raises(PhaseError):
        move(InputState.EXACT, InputEvent.COUNTED)
    counted = move(move(InputState.EXACT, InputEvent.ON_BOUND), InputEvent.COUNTED)
    for ev in (InputEvent.COUNTED, InputEvent.COUNT_FAILED, InputEvent.ADOPTED):
        with pytest.raises(PhaseError):
            move(counted, ev)
    shown = move(move(InputState.EXACT, InputEvent.ON_BOUND), InputEvent.SHOWN_UNCOUNTED)
    assert shown in PENDING and shown in UNCOUNTED
    assert move(shown, InputEvent.COUNTED) is InputState.COUNTED  # checked against the count
