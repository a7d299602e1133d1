"""Unit tests for the request lifecycle transition table (extproc.core.lifecycle)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.lifecycle import TRANSITIONS, Input, Lifecycle, LifecycleError, State

pytestmark = pytest.mark.unit

ALL_PAIRS = list(itertools.product(State, Input))


def at(state: State) -> Lifecycle:
    """A lifecycle placed in ``state``."""
    return Lifecycle(state)


def test_starts_awaiting_headers() -> None:
    """A new lifecycle waits for request headers."""
    assert Lifecycle().state is State.AWAIT_HEADERS


@pytest.mark.parametrize(("state", "inp"), [p for p in ALL_PAIRS if p not in TRANSITIONS])
def test_unlisted_pair_raises_and_keeps_state(state: State, inp: Input) -> None:
    """Every (state, input) pair missing from TRANSITIONS raises and leaves the state alone."""
    life = at(state)
    with pytest.raises(LifecycleError) as info:
        life.advance(inp)
    assert inp.value in str(info.value)
    assert state.value in str(info.value)
    assert life.state is state


@pytest.mark.parametrize(("state", "inp"), list(TRANSITIONS))
def test_listed_pair_moves_to_listed_state(state: State, inp: Input) -> None:
    """Every listed pair moves to the state the table names and returns it."""
    life = at(state)
    assert life.advance(inp) is TRANSITIONS[(state, inp)]
    assert life.state is TRANSITIONS[(state, inp)]


@given(state=st.sampled_from(State), inp=st.sampled_from(Input))
def test_advance_matches_table(state: State, inp: Input) -> None:
    """advance() either follows the table or raises LifecycleError, for any pair."""
    life = at(state)
    expected = TRANSITIONS.get((state, inp))
    if expected is None:
        with pytest.raises(LifecycleError):
            life.advance(inp)
        assert life.state is state
    else:
        assert life.advance(inp) is expected


def test_table_mentions_only_real_members() -> None:
    """The table's keys and values are States and Inputs, and it is not trivially small."""
    assert all(isinstance(s, State) and isinstance(i, Input) for s, i in TRANSITIONS)
    assert all(isinstance(v, State) for v in TRANSITIONS.values())
    assert 0 < len(TRANSITIONS) < len(ALL_PAIRS)


@pytest.mark.parametrize(
    "path",
    [
        # a streamed, admitted request
        [
            Input.REQUEST_HEADERS,
            Input.REQUEST_BODY,
            Input.ADMITTED,
            Input.RESPONSE_HEADERS,
            Input.STREAM_START,
            Input.RESPONSE_BODY,
            Input.RESPONSE_BODY,
            Input.END,
        ],
        # a refused request
        [Input.REQUEST_HEADERS, Input.REFUSED],
        # a stream cut off by the meter; stray body and end afterwards are tolerated
        [
            Input.REQUEST_HEADERS,
            Input.ADMITTED,
            Input.RESPONSE_HEADERS,
            Input.STREAM_START,
            Input.CUT,
            Input.RESPONSE_BODY,
            Input.END,
        ],
        # an unmetered path
        [Input.REQUEST_HEADERS, Input.PASS, Input.RESPONSE_HEADERS, Input.RESPONSE_BODY, Input.END],
    ],
)
def test_typical_paths_are_valid(path: list[Input]) -> None:
    """The request flows the servicer produces are all accepted in order."""
    life = Lifecycle()
    for inp in path:
        life.advance(inp)
    assert life.state in (State.DONE, State.CUT)


def test_out_of_order_messages_rejected() -> None:
    """A body before headers, or admitting twice, is a protocol violation."""
    with pytest.raises(LifecycleError):
        Lifecycle().advance(Input.REQUEST_BODY)
    life = Lifecycle()
    life.advance(Input.REQUEST_HEADERS)
    life.advance(Input.ADMITTED)
    with pytest.raises(LifecycleError):
        life.advance(Input.ADMITTED)
    assert life.state is State.ADMITTED


def test_cut_is_terminal_for_streaming() -> None:
    """Once cut, a stream cannot start again or be admitted."""
    life = at(State.CUT)
    for inp in (Input.STREAM_START, Input.ADMITTED, Input.REQUEST_HEADERS, Input.CUT):
        with pytest.raises(LifecycleError):
            life.advance(inp)
    assert life.advance(Input.END) is State.CUT


# -- the machine as a whole: random message orders, every ending ----------------------------

from extproc.core.lifecycle import Closed, CutReason, Ending  # noqa: E402

OPS = st.one_of(
    st.sampled_from(Input).map(lambda i: ("advance", i)),
    st.sampled_from([Ending.REFUSED, Ending.REJECTED]).map(lambda e: ("refuse", e)),
    st.sampled_from(CutReason).map(lambda r: ("cut", r)),
    st.sampled_from(Ending).map(lambda e: ("name", e)),
)


@given(ops=st.lists(OPS, max_size=25), how=st.sampled_from(Closed))
def test_any_message_order_ends_exactly_once(ops: list[tuple[str, object]], how: Closed) -> None:
    """Whatever Envoy sends in whatever order, the machine either follows the table or
    raises; once named, an ending never changes; closing always yields one; settlement
    begins exactly once."""
    life = Lifecycle()
    first_ending: Ending | None = None
    for op, arg in ops:
        before = life.state
        try:
            if op == "advance":
                assert isinstance(arg, Input)
                expected = TRANSITIONS.get((before, arg))
                if expected is None:
                    with pytest.raises(LifecycleError):
                        life.advance(arg)
                    assert life.state is before
                else:
                    assert life.advance(arg) is expected
            elif op == "refuse":
                assert isinstance(arg, Ending)
                life.refuse(arg)
                assert life.state is State.DONE
            elif op == "cut":
                assert isinstance(arg, CutReason)
                if (before, Input.CUT) in TRANSITIONS:
                    life.cut(arg)
                    assert life.state is State.CUT and life.cut_reason is not None
                else:
                    with pytest.raises(LifecycleError):
                        life.cut(arg)
            else:
                assert isinstance(arg, Ending)
                life.name_ending(arg)
        except LifecycleError:
            assert op in ("advance", "cut")
        if first_ending is None:
            first_ending = life.ending
        assert life.ending is first_ending or first_ending is None
    ending = life.close(how)
    assert isinstance(ending, Ending)
    assert first_ending is None or ending is first_ending
    assert life.close(Closed.ERROR) is ending
    assert life.begin_settlement() is True
    assert life.begin_settlement() is False


@pytest.mark.parametrize(
    ("path", "how", "ending"),
    [
        ([Input.REQUEST_HEADERS], Closed.CANCELLED, Ending.CLIENT_DISCONNECTED),
        (
            [Input.REQUEST_HEADERS, Input.REQUEST_BODY, Input.ADMITTED],
            Closed.EOF,
            Ending.CLIENT_DISCONNECTED,
        ),
        (
            [Input.REQUEST_HEADERS, Input.ADMITTED, Input.RESPONSE_HEADERS, Input.STREAM_START],
            Closed.CANCELLED,
            Ending.CLIENT_DISCONNECTED,
        ),
        (
            [Input.REQUEST_HEADERS, Input.ADMITTED, Input.RESPONSE_HEADERS, Input.STREAM_START],
            Closed.EOF,
            Ending.CLIENT_DISCONNECTED,
        ),
        (
            [Input.REQUEST_HEADERS, Input.ADMITTED, Input.RESPONSE_HEADERS, Input.READ_BODY],
            Closed.CANCELLED,
            Ending.CLIENT_DISCONNECTED,
        ),
        (
            [
                Input.REQUEST_HEADERS,
                Input.ADMITTED,
                Input.RESPONSE_HEADERS,
                Input.STREAM_START,
                Input.END,
            ],
            Closed.CANCELLED,
            Ending.COMPLETED,
        ),
        (
            [
                Input.REQUEST_HEADERS,
                Input.ADMITTED,
                Input.RESPONSE_HEADERS,
                Input.STREAM_START,
                Input.CUT,
            ],
            Closed.EOF,
            Ending.CUT,
        ),
        ([Input.REQUEST_HEADERS, Input.PASS], Closed.EOF, Ending.PASSTHROUGH),
        (
            [Input.REQUEST_HEADERS, Input.ADMITTED, Input.RESPONSE_HEADERS, Input.STREAM_START],
            Closed.SHUTDOWN,
            Ending.SHUTDOWN,
        ),
        ([Input.REQUEST_HEADERS, Input.ADMITTED], Closed.ERROR, Ending.INTERNAL_ERROR),
    ],
)
def test_close_names_the_ending_from_the_phase(
    path: list[Input], how: Closed, ending: Ending
) -> None:
    """The servicer never infers an ending: the machine names it from where it was."""
    life = Lifecycle()
    for inp in path:
        life.advance(inp)
    assert life.close(how) is ending
