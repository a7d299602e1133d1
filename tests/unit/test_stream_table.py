"""The metered stream's transition table (extproc.core.streaming.TRANSITIONS), over any order of
stream events, those it waits for and those it does not (chunks, charge answers on time, late
and duplicate, a failed charge, an abandoned one, the count out of turn, a shutdown cut,
trailers): a pair the table lists moves to one of the states it allows, a pair it does not list
(or an answer with no charge out) is a PhaseError that moves nothing; the state always says
what is out (the charge's answer, the count, nothing), and the table is closed."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import event as note
from hypothesis import strategies as st

from extproc.core import streaming
from extproc.core.keys import unconfirmed_charge
from extproc.core.lifecycle import CutReason, State
from extproc.core.phase_records import PhaseError
from extproc.core.session import Session
from extproc.core.stream_states import StreamState
from extproc.core.stream_vocabulary import (
    STREAM_EVENTS,
    AwaitCharge,
    BodyChunk,
    ChargeAbandoned,
    ChargeAnswered,
    ChargeFailed,
    CountDone,
    CountInput,
    Cut,
    CutNow,
    Forward,
    StartCharge,
    StreamAction,
    StreamEvent,
    Trailers,
)
from extproc.core.streaming import TRANSITIONS, MeteredStream
from tests.table_support import reachable
from tests.unit.test_core_streaming import DONE, open_stream, split
from tests.unit.test_processor_flow import event

pytestmark = pytest.mark.unit

S = StreamState
WAITS = (S.AWAITING_CHARGE, S.AWAITING_COUNT)
ANSWERS = (ChargeAnswered, ChargeFailed)
#: The pairs the table leaves out on purpose: the server sends nothing while it awaits an
#: answer, and reports the count only after asking for it.
REFUSED = {
    (S.AWAITING_CHARGE, BodyChunk),
    (S.AWAITING_COUNT, BodyChunk),
    (S.AWAITING_CHARGE, Trailers),
    (S.AWAITING_COUNT, Trailers),
    (S.METERING, CountDone),
    (S.AWAITING_CHARGE, CountDone),
    (S.ENDED, CountDone),
}
KINDS = (
    "chunk",
    "chunk_answer",
    "answer",
    "refused",
    "failed",
    "late",
    "abandoned",
    "count",
    "cut",
    "trailers",
)
#: "next": what the stream waits for (the answer, the count, the next chunk), drawn often so
#: that orders go deep into the stream, not only its first steps.
DRAWN = ("next",) * 6 + KINDS
order_st = st.lists(st.tuples(st.sampled_from(DRAWN), st.integers(0, 40)), max_size=40)


class Driver:
    """Builds each drawn event as the server would (or would not), and records what is out."""

    def __init__(self, ms: MeteredStream, parts: list[bytes], need: list[bool]) -> None:
        self.ms = ms
        self.parts = parts
        self.next_part = 0
        self.need = need  # whether the exact input count is still to be taken
        self.charge: StartCharge | None = None  # the last charge started
        self.out = False  # its answer is still to come (as far as the server knows)
        self.cuts = 0

    def part(self) -> tuple[bytes, bool]:
        if self.next_part >= len(self.parts):
            return b"", True
        self.next_part += 1
        return self.parts[self.next_part - 1], self.next_part == len(self.parts)

    def answer(self, kind: str, room: int, *, late: bool = False) -> ChargeAnswered | ChargeFailed:
        """An answer to the last charge (to none: an answer nothing asked for)."""
        sc = self.charge
        if kind == "failed":
            return ChargeFailed(maybe_ran=room % 2 == 0, late=late)
        if sc is None:
            return ChargeAnswered(0, False, (), late=late)
        granted = sc.amount if (room % 3 or not sc.strict) else sc.amount // 2
        values = tuple(b.limit.limit - (room - 5) for b in sc.buckets)
        return ChargeAnswered(granted, room % 7 == 0, values, late=late)

    def event(self, kind: str, room: int) -> StreamEvent:
        state = self.ms.state
        if kind == "next":
            kind = {
                S.METERING: "chunk_answer" if self.out and room % 2 else "chunk",
                S.AWAITING_CHARGE: "failed" if room % 9 == 0 else "answer",
                S.AWAITING_COUNT: "count",
                S.ENDED: "chunk",
            }[state]
            if kind == "count":
                self.need[0] = False  # the server takes the count, then reports it
        if kind in ("chunk", "chunk_answer"):
            data, end = self.part()
            return BodyChunk(
                data, end, self.answer("answer", room) if kind == "chunk_answer" else None
            )
        if kind in ("answer", "failed", "late"):
            return self.answer(kind, room, late=kind == "late")
        if kind == "refused":  # a duplicate or an answer nothing asked for
            return self.answer("answer", room)
        if kind == "abandoned":
            return ChargeAbandoned()
        if kind == "count":
            return CountDone()
        if kind == "cut":
            return CutNow(CutReason.SHUTDOWN)
        assert kind == "trailers"
        return Trailers()

    def took(self, ev: StreamEvent, out: list[StreamAction]) -> None:
        """What the stream took and asked for: the charge out, the cuts."""
        answer = ev.answer if isinstance(ev, BodyChunk) else ev
        if isinstance(answer, ANSWERS):
            self.out = False
        for a in out:
            if isinstance(a, StartCharge):
                assert not self.out, "two charges out"
                self.charge, self.out = a, True
            self.cuts += isinstance(a, Cut)


def snapshot(ms: MeteredStream) -> tuple[Any, ...]:
    m, s = ms.meter, ms.s
    return (ms.state, s.life.state, m.counted, m.delivered, s.account.total, s.unconfirmed)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# a full run's draw: a shutdown cut while a charge is out, then that charge's answer, late
@example(
    order=[("next", 0), ("next", 0), ("next", 0), ("cut", 0), ("late", 0)],
    streaming_mode="lazy",
    tpm=12,
    n=5,
    cuts=[1, 2],
    count=False,
)
@given(
    order=order_st,
    streaming_mode=st.sampled_from(["lazy", "strict"]),
    tpm=st.sampled_from([12, 40, 100000]),
    n=st.integers(min_value=1, max_value=12),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=6),
    count=st.booleans(),
)
def test_any_order_of_events_moves_the_stream_by_its_table_only(
    order: list[tuple[str, int]],
    streaming_mode: str,
    tpm: int,
    n: int,
    cuts: list[int],
    count: bool,
) -> None:
    need = [count]
    with pytest.MonkeyPatch.context() as mp:
        # the one fake: whether the exact input count is still to be taken (pure logic; a
        # prompt admitted on a bound has it so until the server counts it)
        mp.setattr(Session, "needs_count", property(lambda s: need[0]))
        proc, ms = open_stream(streaming_mode, tpm)
        body = b"".join([event(f" w{i}") for i in range(n)] + [DONE])
        d = Driver(ms, split(body, cuts), need)
        for kind, room in order:
            ev = d.event(kind, room)
            before = ms.state
            key = S.ENDED if before is S.METERING and ms.s.life.ended else before
            entry = TRANSITIONS.get((key, type(ev)))
            note(f"{key.value} + {type(ev).__name__}")  # which pairs the orders reach
            answer = ev.answer if isinstance(ev, BodyChunk) else ev
            if entry is None or (isinstance(answer, ANSWERS) and not d.out):
                seen = snapshot(ms)
                with pytest.raises(PhaseError):
                    ms.handle(ev)
                assert snapshot(ms) == seen  # refused: nothing moved
                continue
            unconfirmed = ms.s.unconfirmed
            out = ms.handle(ev)
            d.took(ev, out)
            after = ms.state
            assert after in entry[1], f"{before} + {type(ev).__name__} -> {after}: not in the table"
            # only the last action asks for an answer, the one the state waits for
            asks = [a for a in out if isinstance(a, AwaitCharge | CountInput)]
            assert not asks or asks == [out[-1]]
            if asks:
                assert after is (
                    S.AWAITING_CHARGE if isinstance(asks[0], AwaitCharge) else S.AWAITING_COUNT
                )
            if after not in WAITS:
                assert after is (S.ENDED if ms.s.life.ended else S.METERING)
            elif after is not key:
                assert asks, "a wait entered without asking for its answer"
            if after is S.AWAITING_CHARGE:
                assert d.out, "waiting for a charge with none out"
            if isinstance(ev, ChargeAbandoned):
                assert out == [] and after is key
                assert ms.s.unconfirmed == (
                    unconfirmed_charge(d.charge.seq, d.charge.buckets)
                    if d.out and d.charge is not None
                    else unconfirmed
                )
            if isinstance(answer, ANSWERS) and answer.late:
                # bookkeeping only; a wait for it is over (settlement took the answer): the
                # stream meters on, or has ended when a cut came during the wait
                over = S.ENDED if ms.s.life.ended else S.METERING
                assert after is (over if key is S.AWAITING_CHARGE else key)
                assert not any(isinstance(a, Forward | Cut | StartCharge) for a in out)
            if key is S.ENDED:
                assert after is S.ENDED and not any(isinstance(a, Forward | Cut) for a in out)
        assert d.cuts <= 1, "the stream is cut once"
        if ms.state is S.ENDED:
            # over: the count out of turn and an answer with none out are refused
            seen = snapshot(ms)
            for late in (CountDone(), d.answer("answer", 1)):
                if isinstance(late, CountDone) or not d.out:
                    with pytest.raises(PhaseError):
                        ms.handle(late)
                    assert snapshot(ms) == seen
            assert ms.s.life.state in (State.CUT, State.DONE)
        del proc


def test_the_table_is_closed() -> None:
    """Every state is reached from METERING; each wait takes its answer and a cut (and the
    end of the request: an abandoned charge); ENDED leads nowhere else; the pairs left out are
    exactly those the server never sends."""
    assert reachable(TRANSITIONS, S.METERING) == set(S)
    listed = set(TRANSITIONS)
    every = {(state, ev) for state in S for ev in STREAM_EVENTS}
    assert listed <= every
    assert every - listed == REFUSED
    for (state, ev), (step, allowed) in TRANSITIONS.items():
        assert allowed, f"{state} + {ev.__name__} leads nowhere"
        assert callable(step) and step.__name__ in MeteredStream.__dict__
        if state is S.ENDED:
            assert allowed == {S.ENDED}
    assert TRANSITIONS[(S.AWAITING_COUNT, CountDone)][1] == set(S)
    for ev in ANSWERS:
        assert (S.AWAITING_CHARGE, ev) in listed
    for state in WAITS:
        assert TRANSITIONS[(state, CutNow)][1] == {state}  # the wait stays for its answer
    for state in S:
        assert TRANSITIONS[(state, ChargeAbandoned)][1] == {state}


def test_a_step_may_not_lead_where_the_table_does_not_allow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The table is the rule: a step that returns a state its entry does not list is a
    PhaseError and the stream does not move."""

    def astray(ms: MeteredStream, ev: Any, out: list[StreamAction]) -> StreamState:
        return S.AWAITING_CHARGE

    key = (S.METERING, Trailers)
    monkeypatch.setitem(streaming.TRANSITIONS, key, (astray, TRANSITIONS[key][1]))
    proc, ms = open_stream("lazy", 100000)
    with pytest.raises(PhaseError, match="may not move"):
        ms.handle(Trailers())
    assert ms.state is S.METERING
    del proc


def test_a_duplicate_answer_is_refused_and_bills_nothing() -> None:
    """The same charge answered twice (or an answer nothing asked for): the second is a
    PhaseError, the account is not charged twice."""
    proc, ms = open_stream("lazy", 100000)
    with pytest.raises(PhaseError):
        ms.handle(ChargeAnswered(0, False, ()))
    started: StartCharge | None = None
    for i in range(12):
        out = ms.handle(BodyChunk(event(f" w{i}"), False))
        started = next((a for a in out if isinstance(a, StartCharge)), None)
        if started is not None:
            break
    assert started is not None
    answer = ChargeAnswered(started.amount, False, tuple(0 for _ in started.buckets))
    ms.handle(BodyChunk(event(" x"), False, answer))
    total = ms.s.account.total
    assert total > 0
    for again in (answer, BodyChunk(event(" y"), False, answer)):
        with pytest.raises(PhaseError):
            ms.handle(again)
        assert ms.s.account.total == total and ms.state is S.METERING
    del proc
