"""Where a request's input figure stands (sans-IO, a transition table): counted exactly at
admission, or admitted on an upper bound and then shown at the upstream's figure without a
count, counted, kept at the bound when the count failed, or taken at the upstream's figure as
its count at settlement.  The session (:mod:`extproc.core.session`) holds one
:class:`InputState`; every flag it shows about the input is read off it."""

from __future__ import annotations

from enum import Enum

from extproc.core.phase_records import PhaseError


class InputState(Enum):
    """Where the input figure stands."""

    __hash__ = object.__hash__  # as lifecycle.State's: looked up per move

    EXACT = "exact"  # admitted on the exact count (or not admitted on a bound)
    BOUND = "bound"  # admitted on an upper bound, not counted
    UNCOUNTED = "uncounted"  # on a bound: a figure shown at the upstream's input, no count
    COUNTED = "counted"  # on a bound, counted since
    KEPT_BOUND = "kept_bound"  # on a bound, the count failed: the bound stands (an over-count)
    ADOPTED = "adopted"  # on a bound: the upstream's figure, within its proven range, is the count


class InputEvent(Enum):
    """What moves it."""

    __hash__ = object.__hash__

    ON_BOUND = "on_bound"  # admission decided on a bound
    SHOWN_UNCOUNTED = "shown_uncounted"  # a figure taken at the upstream's input, uncounted
    COUNTED = "counted"  # the exact count arrived
    COUNT_FAILED = "count_failed"  # the count could not be taken: the bound stands
    ADOPTED = "adopted"  # settlement took the upstream's figure as the count


_S, _E = InputState, InputEvent
#: Every legal move; any other is a PhaseError (a count twice, a count of an exact input...).
INPUT_TRANSITIONS: dict[tuple[InputState, InputEvent], InputState] = {
    (_S.EXACT, _E.ON_BOUND): _S.BOUND,
    (_S.BOUND, _E.SHOWN_UNCOUNTED): _S.UNCOUNTED,
    (_S.UNCOUNTED, _E.SHOWN_UNCOUNTED): _S.UNCOUNTED,
    (_S.ADOPTED, _E.SHOWN_UNCOUNTED): _S.ADOPTED,
    (_S.BOUND, _E.COUNTED): _S.COUNTED,
    (_S.UNCOUNTED, _E.COUNTED): _S.COUNTED,  # a figure shown before is checked against it
    (_S.BOUND, _E.COUNT_FAILED): _S.KEPT_BOUND,
    (_S.UNCOUNTED, _E.COUNT_FAILED): _S.KEPT_BOUND,
    (_S.BOUND, _E.ADOPTED): _S.ADOPTED,
    (_S.UNCOUNTED, _E.ADOPTED): _S.ADOPTED,
}

#: Admitted on a bound whose exact count has not been taken.
PENDING = frozenset((_S.BOUND, _S.UNCOUNTED))
#: Billed (or about to be) at the upstream's own input figure without a count.
UNCOUNTED = frozenset((_S.UNCOUNTED, _S.ADOPTED))
#: Admitted on a bound, and a count (or what stands for one) has replaced it since.
COUNTED_AFTER_BOUND = frozenset((_S.COUNTED, _S.KEPT_BOUND, _S.ADOPTED))


def move(state: InputState, event: InputEvent) -> InputState:
    """The state after ``event`` (:data:`INPUT_TRANSITIONS`)."""
    to = INPUT_TRANSITIONS.get((state, event))
    if to is None:
        raise PhaseError(f"the input figure cannot move from {state.value} on {event.value}")
    return to
