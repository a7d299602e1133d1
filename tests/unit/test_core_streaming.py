"""The core's metered stream driven by events alone (no server executing its actions): for any
split of the upstream's bytes, any timing and content of the limiter's answers (grants,
exhaustion, failures) and either charging mode, the actions it returns keep the stream's
contract: events pass whole and in order, one charge at a time, a wait or a count is the last
action of its list, the stream ends once (its end or its cut) and its final figure is decided
once."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.core.keys import room_after, unconfirmed_charge
from extproc.core.lifecycle import CutReason, Ending, State
from extproc.core.meter_phase import StreamPhase
from extproc.core.phase_records import PhaseError
from extproc.core.stream_states import StreamState
from extproc.core.stream_vocabulary import (
    AwaitCharge,
    BodyChunk,
    ChargeAbandoned,
    ChargeAnswered,
    ChargeError,
    ChargeFailed,
    CountDone,
    CountInput,
    Cut,
    Forward,
    ShadowExceeded,
    StalledWithoutCharge,
    StartCharge,
    StreamAction,
    StreamEvent,
    Trailers,
)
from extproc.core.streaming import MeteredStream
from extproc.server.processor import RequestProcessor
from tests.unit.test_processor_flow import event, limiter, start

pytestmark = pytest.mark.unit

DONE = b"data: [DONE]\n\n"


def open_stream(streaming: str, tpm: int) -> tuple[RequestProcessor, MeteredStream]:
    """A request admitted through the real processor, its response's stream started: the
    core's stream, to drive without the server."""
    proc = asyncio.run(start(limiter(), streaming, tpm))
    assert proc.driver is not None
    return proc, proc.driver.stream


@dataclass
class Answer:
    """How the limiter answers one charge."""

    fail: bool
    maybe_ran: bool
    grant_all: bool
    exhausted: bool
    room: int


answers = st.builds(
    Answer,
    fail=st.sampled_from([False, False, False, True]),
    maybe_ran=st.booleans(),
    grant_all=st.sampled_from([True, True, False]),
    exhausted=st.sampled_from([False, False, True]),
    room=st.integers(min_value=-5, max_value=50),
)


class Run:
    """Feeds events, answers charges as told, and checks every list of actions it gets."""

    def __init__(self, ms: MeteredStream, script: list[Answer], answer_now: list[bool]) -> None:
        self.ms = ms
        self.script = script
        self.answer_now = answer_now
        self.charges = 0
        self.pending: StartCharge | None = None
        self.forwarded = b""
        self.ended_by: str | None = None
        self.finals: list[int] = []
        self.cut: Cut | None = None

    def _answer(self) -> ChargeAnswered | ChargeFailed:
        sc = self.pending
        assert sc is not None
        self.pending = None
        a = self.script[self.charges % len(self.script)]
        self.charges += 1
        if a.fail:
            return ChargeFailed(a.maybe_ran)
        granted = sc.amount if (a.grant_all or not sc.strict) else sc.amount // 2
        values = tuple(b.limit.limit - a.room for b in sc.buckets)
        return ChargeAnswered(granted, a.exhausted, values)

    def feed(self, ev: StreamEvent) -> None:
        self.run(self.ms.handle(ev))

    def run(self, actions: list[StreamAction]) -> None:
        while actions:
            nxt: list[StreamAction] = []
            for i, a in enumerate(actions):
                last = i == len(actions) - 1
                if isinstance(a, Forward):
                    assert self.ended_by is None, "bytes after the stream's end"
                    self.forwarded += a.data
                    if a.output_tokens is not None:
                        self.finals.append(a.output_tokens)
                    if a.end_stream:
                        self.ended_by = "end"
                elif isinstance(a, Cut):
                    assert self.ended_by is None, "a cut after the stream's end"
                    self.ended_by = "cut"
                    self.forwarded += a.data
                    self.cut = a
                    self.finals.append(a.output_tokens)
                elif isinstance(a, StartCharge):
                    assert self.pending is None, "two charges in flight"
                    assert a.amount > 0
                    self.pending = a
                elif isinstance(a, AwaitCharge):
                    assert last, "a wait must be the last action"
                    assert self.pending is not None, "a wait with no charge in flight"
                    nxt = self.ms.handle(self._answer())
                elif isinstance(a, CountInput):
                    assert last, "a count must be the last action"
                    nxt = self.ms.handle(CountDone())
                else:
                    assert isinstance(a, ChargeError | ShadowExceeded | StalledWithoutCharge)
            actions = nxt

    def chunk(self, data: bytes, end: bool, k: int) -> None:
        answer = None
        if self.pending is not None and self.answer_now[k % len(self.answer_now)]:
            answer = self._answer()
        self.feed(BodyChunk(data, end, answer))


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)] or [b""]


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    streaming=st.sampled_from(["lazy", "strict"]),
    tpm=st.sampled_from([12, 40, 100000]),
    n=st.integers(min_value=1, max_value=30),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
    script=st.lists(answers, min_size=1, max_size=6),
    answer_now=st.lists(st.booleans(), min_size=1, max_size=6),
    trailers=st.booleans(),
)
def test_any_event_order_keeps_the_stream_contract(
    streaming: str,
    tpm: int,
    n: int,
    cuts: list[int],
    script: list[Answer],
    answer_now: list[bool],
    trailers: bool,
) -> None:
    """Whatever the splits and the answers: forwarded bytes are whole events in order (then,
    when cut, the API's error event), the stream ends exactly once, a charge is in flight at
    most once, and every final figure given is the same one."""
    proc, ms = open_stream(streaming, tpm)
    events = [event(f" w{i}") for i in range(n)] + [DONE]
    body = b"".join(events)
    parts = split(body, cuts)
    run = Run(ms, script, answer_now)
    for k, part in enumerate(parts):
        run.chunk(part, k == len(parts) - 1 and not trailers, k)
        if run.ended_by is not None:
            break
    if trailers and run.ended_by is None:
        run.feed(Trailers())
        run.chunk(b"", True, len(parts))
    if run.ended_by == "cut":
        assert run.cut is not None
        assert run.forwarded.endswith(run.cut.data)
        passed = run.forwarded[: len(run.forwarded) - len(run.cut.data)]
        assert body.startswith(passed)
        assert passed == b"".join(events[: passed.count(b"\n\n")])
        assert ms.s.life.state is State.CUT
        assert not ms.complete
        # a stream whose terminal event had passed stays completed (the first ending named
        # wins; as before the core took this over, a failed charge still cuts it after)
        completed = passed.endswith(DONE)
        assert ms.s.life.ending is (Ending.COMPLETED if completed else Ending.CUT)
        # the meter's phase says the same: cut, for the cut's reason; complete as the bytes
        assert ms.meter.phase.stream is StreamPhase.CUT
        assert ms.meter.cut_reason is run.cut.reason
        assert ms.meter.complete is completed
    else:
        # not cut: every event passed, and the end went out once
        assert run.forwarded == body
        assert run.ended_by == "end"
        assert ms.complete
        assert ms.s.life.state is State.DONE
        assert ms.meter.phase.stream is StreamPhase.FINISHED
        assert ms.meter.complete and ms.meter.cut_reason is None
    assert run.finals, "the final figures went out"
    assert len(set(run.finals)) == 1, "the final figure is decided once"
    assert ms.meter.delivered <= ms.meter.counted
    # whatever happened, the core's answer to "what was delivered" is what the figure says
    end = ms.end()
    assert end.cut is (run.ended_by == "cut")
    # the stream waits for nothing once over; a duplicate count is refused and changes nothing
    assert ms.state is StreamState.ENDED
    forwarded = run.forwarded
    with pytest.raises(PhaseError):
        run.feed(CountDone())
    assert run.forwarded == forwarded and ms.state is StreamState.ENDED
    del proc


def test_a_charge_abandoned_at_settlement_is_marked_unconfirmed_once() -> None:
    """Settlement stopped waiting for a charge in flight: the session records it unconfirmed
    (by its sequence number and buckets); with nothing in flight, nothing is recorded."""
    proc, ms = open_stream("lazy", 100000)
    ms.handle(ChargeAbandoned())
    assert ms.s.unconfirmed is None
    started: list[StartCharge] = []
    for i in range(12):
        started += [
            a for a in ms.handle(BodyChunk(event(f" w{i}"), False)) if isinstance(a, StartCharge)
        ]
        if started:
            break
    assert started, "a lazy stream asks for a charge every N tokens"
    ms.handle(ChargeAbandoned())
    assert ms.s.unconfirmed == unconfirmed_charge(started[0].seq, started[0].buckets)
    del proc


def test_a_failed_charge_cuts_or_goes_unmetered_as_the_plan_says() -> None:
    """A charge the limiter failed cuts the stream (fail-closed, the default): the core says
    so with the backend-unavailable cut, after counting the error."""
    proc, ms = open_stream("lazy", 100000)
    run = Run(ms, [Answer(True, True, True, False, 0)], [True])
    for i in range(12):
        run.chunk(event(f" w{i}"), False, i)
    assert run.ended_by == "cut" and run.cut is not None
    assert run.cut.reason is CutReason.BACKEND_UNAVAILABLE
    assert ms.s.unconfirmed is not None  # it may have run: settlement takes it back
    del proc


def test_room_after_is_the_tightest_enforced_buckets_output_room() -> None:
    """The room a charge leaves: the smallest over enforced buckets pricing output of what is
    left under the limit, in output tokens; none when no such bucket."""
    proc, ms = open_stream("lazy", 1000)
    buckets = ms.s.buckets_at("p", 0, 1000)
    tpm = [b for b in buckets if b.kind == "tpm"]
    assert tpm
    assert room_after(tpm, [b.limit.limit - 7 for b in tpm]) == 7
    assert room_after([], []) is None
    del proc
