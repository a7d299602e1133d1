"""Unit tests for the sans-IO stream meter: lazy and strict charging over real SSE bytes (extproc.core.meter)."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.apis.errors import sse_error_event
from extproc.core.chunks import Usage
from extproc.core.lifecycle import CutReason
from extproc.core.meter import EMPTY, Step, StreamMeter
from extproc.core.meter_phase import (
    CUTTING,
    ENFORCEMENT_TRANSITIONS,
    STREAM_TRANSITIONS,
    UPSTREAM_OPEN,
    Enforcement,
    EnforcementInput,
    MeterPhase,
    StreamInput,
    StreamPhase,
)
from extproc.core.tokens import TokenizerSpec
from extproc.tokenizers import load_counter

pytestmark = pytest.mark.unit

DONE = b"data: [DONE]\n\n"


def words(text: str) -> int:
    """A simple token counter: whitespace-separated words."""
    return len(text.split())


def ev(text: str, index: int = 0) -> bytes:
    """One chat.completion.chunk SSE event carrying ``text`` as delta content."""
    obj = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": index, "delta": {"content": text}, "finish_reason": None}],
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def usage_ev(prompt: int, completion: int) -> bytes:
    """The usage-only chunk (``choices: []``) sent when include_usage is on."""
    obj: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def lazy(every: int = 5, **kw: Any) -> StreamMeter:
    """A lazy, enforcing meter counting words."""
    return StreamMeter(count=words, every=every, strict=False, **kw)


def strict(every: int = 10, lease: int = 10, **kw: Any) -> StreamMeter:
    """A strict, enforcing meter counting words with an initial lease."""
    return StreamMeter(count=words, every=every, strict=True, initial_lease=lease, **kw)


# -- lazy ----------------------------------------------------------------------------------


def test_lazy_forwards_each_complete_event_immediately() -> None:
    """Lazy mode forwards a complete event at once, uncharged below ``every``."""
    m = lazy()
    e = ev("a b c")
    step = m.feed(e, end=False)
    assert step == Step(forward=e)
    assert (m.delivered, m.uncharged, m.counted, m.stats.events) == (3, 3, 3, 1)


def test_lazy_charges_once_every_passed_and_not_while_in_flight() -> None:
    """A charge of all uncharged tokens is asked at ``every``; none while it is in flight."""
    m = lazy(every=5)
    assert m.feed(ev("a b c"), end=False).charge == 0
    step = m.feed(ev("d e f"), end=False)
    assert step.charge == 6
    assert step.forward == ev("d e f")
    assert m._charge_in_flight
    step = m.feed(ev("g h i j"), end=False)
    assert step.charge == 0
    assert step.forward == ev("g h i j")
    assert m.on_charge(6, exhausted=False) == Step()
    assert not m._charge_in_flight
    assert (m.charged, m.uncharged) == (6, 4)
    assert m.feed(ev("k"), end=False).charge == 5


def test_lazy_holds_events_when_redis_falls_two_batches_behind() -> None:
    """With a charge in flight and 2N tokens uncharged, lazy waits for Redis (the safety valve)."""
    m = lazy(every=5)
    assert m.feed(ev("a b c d e f"), end=False).charge == 6
    assert m.feed(ev("g h i j"), end=False).forward == ev("g h i j")
    step = m.feed(ev("k l"), end=False)
    assert step.forward == b"" and step.blocked
    released = m.on_charge(6, exhausted=False)
    assert released.forward == ev("k l") and released.charge == 6 and not released.blocked
    assert m.delivered == 12


def test_lazy_cuts_held_events_when_the_charge_says_exhausted() -> None:
    """Events held behind a slow charge are not delivered when that charge exhausts the quota."""
    m = lazy(every=5)
    m.feed(ev("a b c d e f"), end=False)
    m.feed(ev("g h i j"), end=False)
    assert m.feed(ev("k l"), end=False).blocked
    step = m.on_charge(6, exhausted=True)
    assert step.cut_reason == CutReason.QUOTA_EXHAUSTED and step.forward == b""
    assert m.delivered == 10


def test_lazy_cuts_on_feed_after_exhausted_charge() -> None:
    """After a charge reports exhaustion the next feed forwards nothing and cuts."""
    m = lazy(every=2)
    assert m.feed(ev("a b"), end=False).charge == 2
    assert m.on_charge(2, exhausted=True) == EMPTY
    step = m.feed(ev("c d"), end=False)
    assert step.forward == b""
    assert step.cut_reason == CutReason.QUOTA_EXHAUSTED
    assert m.cut_reason == CutReason.QUOTA_EXHAUSTED
    assert m.delivered == 2


def test_lazy_no_charge_at_end_of_stream() -> None:
    """The final feed ends the stream and leaves the remainder to settlement."""
    m = lazy(every=2)
    step = m.feed(ev("a b c d") + DONE, end=True)
    assert step.forward == ev("a b c d") + DONE
    assert step.end_stream is True
    assert step.charge == 0
    assert m.upstream_done
    assert m.finished
    assert m.uncharged == 4


def test_lazy_final_chunk_past_the_cap_is_charged_before_it_passes() -> None:
    """A last chunk (with [DONE]) carrying more than 2N uncharged tokens: the events past the
    cap wait for a charge, which is asked for (found by the soak: the meter returned 'blocked'
    with no charge in flight and the driver had to stop enforcing)."""
    m = lazy(every=2)
    step = m.feed(ev("a b") + ev("c d") + ev("e f") + DONE, end=True)
    assert step.blocked and step.charge == 2 and m._charge_in_flight
    assert step.forward == ev("a b") + ev("c d") and not step.end_stream
    done = m.on_charge(2, exhausted=False)
    assert done.forward == ev("e f") + DONE and done.end_stream
    assert m.delivered == 6 and m.finished


def test_lazy_final_chunk_past_the_cap_is_cut_when_exhausted() -> None:
    """The same chunk when that charge exhausts the quota: the held events never pass."""
    m = lazy(every=2)
    m.feed(ev("a b") + ev("c d") + ev("e f") + DONE, end=True)
    step = m.on_charge(2, exhausted=True)
    assert step.cut_reason == CutReason.QUOTA_EXHAUSTED and m.delivered == 4


def test_lazy_feed_after_finish_is_empty() -> None:
    """Once finished, feeds do nothing."""
    m = lazy()
    m.feed(DONE, end=True)
    assert m.feed(ev("late"), end=False) == EMPTY


def test_enforce_false_never_asks_for_charges() -> None:
    """With enforce off (metering only) the meter counts but never asks to charge."""
    for is_strict in (False, True):
        m = StreamMeter(count=words, every=1, strict=is_strict, enforce=False, initial_lease=0)
        body = ev("a b c d e") * 4
        step = m.feed(body, end=False)
        assert step == Step(forward=body)
        assert m.counted == 20
        assert m.delivered == 20
        step = m.feed(DONE, end=True)
        assert step.end_stream
        assert step.charge == 0


# -- strict --------------------------------------------------------------------------------


def test_strict_forwards_within_lease() -> None:
    """An event that fits the lease is forwarded and consumes it."""
    m = strict(every=10, lease=10)
    step = m.feed(ev("a b c d e"), end=False)
    assert step.forward == ev("a b c d e")
    assert step.blocked is False
    assert step.charge == 0  # 5 left is exactly half of every: no early renewal yet
    assert m.lease == 5


def test_strict_early_renewal_below_half_every() -> None:
    """When less than half of ``every`` is left the meter asks for ``every`` more."""
    m = strict(every=10, lease=10)
    m.feed(ev("a b c d e"), end=False)
    step = m.feed(ev("f"), end=False)
    assert step.forward == ev("f")
    assert step.charge == 10
    assert m.lease == 4


def test_strict_holds_event_that_does_not_fit() -> None:
    """An event bigger than the lease is held: nothing forwarded, blocked, renewal asked."""
    m = strict(every=4, lease=10)
    big = ev(" ".join(["w"] * 30))
    step = m.feed(big, end=False)
    assert step.forward == b""
    assert step.blocked is True
    assert step.charge == 20  # big enough to release the event, more than every
    assert m.delivered == 0
    assert m.lease == 10


def test_strict_renewal_at_least_every() -> None:
    """A small shortfall still renews at least ``every``."""
    m = strict(every=8, lease=2)
    step = m.feed(ev("a b c"), end=False)
    assert step.blocked
    assert step.charge == 8


def test_strict_releases_held_events_in_order_after_grant() -> None:
    """Held events are released in arrival order once a grant covers them."""
    m = strict(every=10, lease=2)
    e1, e2, e3 = ev("a b c"), ev("d"), ev("e f")
    s1 = m.feed(e1, end=False)
    assert s1.blocked
    assert s1.charge == 10
    s2 = m.feed(e2 + e3, end=False)
    assert s2.forward == b""  # e2 would fit, but order is kept behind e1
    assert s2.blocked
    assert s2.charge == 0  # a renewal is already in flight
    step = m.on_charge(10, exhausted=False)
    assert step.forward == e1 + e2 + e3
    assert step.blocked is False
    assert m.lease == 12 - 6
    assert m.delivered == 6
    assert step.charge == 0  # 6 left is more than half of 10


def test_strict_partial_release_asks_again() -> None:
    """A grant that covers only the first held event releases it and asks for the rest."""
    m = strict(every=4, lease=0)
    e1, e2 = ev("a b c d"), ev("e f g h i j")
    s = m.feed(e1 + e2, end=False)
    assert s.charge == 10
    assert s.blocked
    step = m.on_charge(4, exhausted=False)
    assert step.forward == e1
    assert step.blocked is True
    assert step.charge == 6
    assert m.exhausted  # granted less than asked
    step = m.on_charge(6, exhausted=False)
    assert step.forward == e2
    assert step.blocked is False


def test_strict_cuts_when_renewal_grants_zero_with_events_held() -> None:
    """A renewal granting nothing while events are held cuts the stream."""
    m = strict(every=10, lease=1)
    m.feed(ev("a b c"), end=False)
    step = m.on_charge(0, exhausted=True)
    assert step.cut_reason == CutReason.QUOTA_EXHAUSTED
    assert step.forward == b""
    assert m.delivered == 0
    assert m.stats.leased_total - m.delivered == 1


def test_strict_held_behind_early_renewal_cut_on_zero_grant() -> None:
    """An event held while an early renewal is in flight is cut when that renewal grants 0."""
    m = strict(every=10, lease=10)
    assert m.feed(ev("a b c d e f"), end=False).charge == 10  # 4 left: early renewal
    step = m.feed(ev("g h i j k"), end=False)  # 5 > 4: held, renewal already asked
    assert step.blocked
    assert step.charge == 0
    step = m.on_charge(0, exhausted=True)
    assert step.cut_reason == CutReason.QUOTA_EXHAUSTED
    assert step.forward == b""
    assert m.delivered == 6
    assert m.stats.leased_total - m.delivered == 4


def test_strict_zero_grant_without_held_does_not_cut() -> None:
    """An early renewal granting nothing with nothing held does not cut; no more early asks."""
    m = strict(every=10, lease=10)
    m.feed(ev("a b c d e f g h i"), end=False)
    step = m.on_charge(0, exhausted=True)
    assert step.cut_reason is None
    assert m.exhausted
    step = m.feed(ev("j"), end=False)
    assert step.forward == ev("j")
    assert step.charge == 0  # exhausted: no early renewal
    step = m.feed(ev("k"), end=False)
    assert step.blocked
    assert step.charge == 10  # a held event still asks
    assert m.on_charge(0, exhausted=True).cut_reason == CutReason.QUOTA_EXHAUSTED


def test_strict_tokens_delivered_never_exceed_leased() -> None:
    """In strict mode delivered tokens stay within what was leased."""
    m = strict(every=3, lease=3)
    for text in ["a b", "c d e", "f", "g h i j", "k"]:
        step = m.feed(ev(text), end=False)
        if step.charge:
            m.on_charge(step.charge // 2, exhausted=False)
        assert m.delivered <= m.stats.leased_total


def test_strict_end_with_held_waits_for_grant() -> None:
    """End of stream with events held is not the end until a grant releases them."""
    m = strict(every=10, lease=1)
    step = m.feed(ev("a b") + DONE, end=True)
    assert step.end_stream is False
    assert step.blocked
    assert step.charge == 10
    assert not m.finished
    step = m.on_charge(10, exhausted=False)
    assert step.forward == ev("a b") + DONE
    assert step.end_stream is True
    assert step.charge == 0
    assert m.finished


def test_strict_end_without_held_ends_and_no_renewal() -> None:
    """End of stream with nothing held ends at once and asks no early renewal."""
    m = strict(every=10, lease=10)
    step = m.feed(ev("a b c d e f g h i") + DONE, end=True)
    assert step.end_stream is True
    assert step.charge == 0
    assert m.stats.leased_total - m.delivered == 1


def test_on_charge_after_finish_records_grant_only() -> None:
    """A late grant after the stream finished is counted as charged and does nothing else."""
    m = lazy(every=1)
    assert m.feed(ev("a"), end=False).charge == 1
    m.feed(DONE, end=True)
    assert m.on_charge(1, exhausted=False) == EMPTY
    assert m.charged == 1


def test_on_charge_failed_clears_in_flight() -> None:
    """A failed charge lets the meter ask again."""
    m = lazy(every=2)
    assert m.feed(ev("a b"), end=False).charge == 2
    m.on_charge_failed()
    assert not m._charge_in_flight
    assert m.feed(ev("c"), end=False).charge == 3


# -- usage, malformed, framing -------------------------------------------------------------


def test_strip_usage_drops_usage_only_event_but_records_usage() -> None:
    """With strip_usage the usage-only chunk is not forwarded but meter.stats.usage is set."""
    m = lazy(every=100, strip_usage=True)
    step = m.feed(ev("a b") + usage_ev(7, 2) + DONE, end=True)
    assert step.forward == ev("a b") + DONE
    assert m.stats.usage == Usage(7, 2, 9)
    assert m.stats.events == 3


def test_usage_event_forwarded_without_strip() -> None:
    """Without strip_usage the usage chunk is forwarded and recorded."""
    m = lazy(every=100)
    body = ev("a b") + usage_ev(7, 2) + DONE
    assert m.feed(body, end=True).forward == body
    assert m.stats.usage == Usage(7, 2, 9)


def test_malformed_event_forwarded_and_counted_on_raw_data() -> None:
    """A non-JSON event is forwarded byte-exact and its raw data is counted."""
    m = lazy(every=100)
    bad = b"data: {not json at all\n\n"
    step = m.feed(bad + ev("x"), end=False)
    assert step.forward == bad + ev("x")
    assert m.stats.malformed_events == 1
    assert m.counted == 4 + 1  # "{not", "json", "at", "all" + "x"


def test_comment_event_forwarded_uncounted() -> None:
    """An SSE comment (keep-alive) is forwarded and costs nothing."""
    m = strict(every=10, lease=0)
    step = m.feed(b": keep-alive\n\n", end=False)
    assert step.forward == b": keep-alive\n\n"
    assert m.counted == 0


def test_upstream_error_event_recorded() -> None:
    """An in-stream error object from the upstream is remembered."""
    m = lazy()
    err = b'data: {"error": {"message": "boom", "type": "server_error"}}\n\n'
    assert m.feed(err, end=False).forward == err
    assert m.stats.upstream_error == {"message": "boom", "type": "server_error"}


def test_partial_event_held_until_complete() -> None:
    """An incomplete event is not forwarded until its terminating blank line arrives."""
    m = lazy(every=100)
    e = ev("hello world")
    assert m.feed(e[:-1], end=False).forward == b""
    assert m.feed(e[-1:], end=False).forward == e


STREAM = ev("Hello there") + ev(" — héllo wörld 🎉") + ev("") + usage_ev(3, 4) + DONE


@settings(max_examples=200)
@given(cuts=st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_split_feeds_forward_whole_events_byte_exact(cuts: list[int]) -> None:
    """Split at arbitrary bytes, the stream is forwarded whole-event by whole-event, byte-exact."""
    bounds = [0, *sorted(cuts), len(STREAM)]
    pieces = [STREAM[a:b] for a, b in itertools.pairwise(bounds)]
    m = lazy(every=1000)
    out = b""
    for i, piece in enumerate(pieces):
        step = m.feed(piece, end=i == len(pieces) - 1)
        if step.forward:
            assert step.forward.endswith(b"\n\n")
            assert (out + step.forward) == STREAM[: len(out) + len(step.forward)]
        out += step.forward
    assert out == STREAM
    assert m.counted == 2 + 4
    assert m.stats.events == 5


def test_real_tokenizer_counts_content() -> None:
    """With the cl100k counter the meter counts each delta's tokens."""
    counter = load_counter(TokenizerSpec(kind="tiktoken", encoding="cl100k_base"))
    m = StreamMeter(count=counter.count, every=1000, strict=False)
    texts = ["Hello", " world", ", how are you today?"]
    m.feed(b"".join(ev(t) for t in texts), end=False)
    assert m.counted == sum(counter.count(t) for t in texts)
    assert m.counted == 1 + 1 + 6


# -- cut -----------------------------------------------------------------------------------


def test_cut_returns_error_event_then_done() -> None:
    """cut() returns the error event followed by [DONE] and finishes the meter."""
    m = strict(every=10, lease=1)
    m.feed(ev("a b c"), end=False)
    err = sse_error_event("quota gone", error_type="tokens", code="tpm_limit_exceeded")
    out = m.cut(err + DONE)
    assert out == err + DONE
    assert m.finished
    assert m.cut_reason == CutReason.QUOTA_EXHAUSTED
    assert m.feed(ev("more"), end=False) == EMPTY
    assert m.delivered == 0


def test_cut_keeps_existing_reason() -> None:
    """A reason already decided by the meter survives cut(), and a later one does not
    replace it (the first cut's reason stands)."""
    m = StreamMeter(count=words, every=10, strict=False, max_event_bytes=64)
    assert m.feed(ev("x " * 100), end=False).cut_reason == CutReason.EVENT_TOO_LARGE
    assert m.fail(CutReason.BACKEND_UNAVAILABLE).cut_reason == CutReason.BACKEND_UNAVAILABLE
    assert m.cut_reason == CutReason.EVENT_TOO_LARGE
    m.cut(b"data: {}\n\n")
    assert m.cut_reason == CutReason.EVENT_TOO_LARGE and m.finished


def test_flags_are_read_only() -> None:
    """The flags that repeat the phase are derived: they cannot be written around it."""
    m = lazy()
    for flag, value in (
        ("complete", True),
        ("exhausted", True),
        ("enforce", False),
        ("cut_reason", CutReason.SHUTDOWN),
    ):
        with pytest.raises(AttributeError):
            setattr(m, flag, value)


def test_event_too_large_cuts() -> None:
    """An upstream event beyond max_event_bytes cuts the stream."""
    m = StreamMeter(count=words, every=10, strict=False, max_event_bytes=64)
    step = m.feed(ev("x " * 100), end=False)
    assert step.cut_reason == CutReason.EVENT_TOO_LARGE
    assert step.forward == b""


def test_lazy_batches_shrink_when_the_quota_is_nearly_used() -> None:
    """Once a charge reports less than 16N left, lazy charges every N/4 tokens."""
    m = lazy(every=8)
    assert m.feed(ev("a b c d e f g h"), end=False).charge == 8
    m.on_charge(8, exhausted=False, room=1000)
    assert m.batch == 8
    assert m.feed(ev("a b c d e f g h"), end=False).charge == 8
    m.on_charge(8, exhausted=False, room=20)
    assert m.batch == 2
    assert m.feed(ev("a b"), end=False).charge == 2


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=30),
    cuts=st.lists(st.integers(0, 400), max_size=8),
    every=st.integers(1, 8),
    answer_late=st.booleans(),
)
def test_lazy_never_blocks_without_a_charge_and_keeps_the_cap(
    sizes: list[int], cuts: list[int], every: int, answer_late: bool
) -> None:
    """Any events, any chunking, the last chunk ending the stream: whenever the meter holds
    events a charge is in flight, at most 2N tokens pass uncharged, and everything arrives."""
    body = b"".join(ev(" ".join("w" for _ in range(n))) for n in sizes) + DONE
    points = sorted({min(c, len(body)) for c in cuts} | {len(body)})
    m = lazy(every=every)
    delivered = 0
    pending: list[int] = []

    def apply(step: Step) -> None:
        nonlocal delivered
        while True:
            delivered += step.forward.count(b"data: {")
            assert m.uncharged <= 2 * every or not m.enforce
            if step.charge:
                pending.append(step.charge)
            if not step.blocked:
                return
            assert m._charge_in_flight and pending, "held events with no charge in flight"
            step = m.on_charge(pending.pop(), exhausted=False)

    start = 0
    for p in points:
        apply(m.feed(body[start:p], end=p == len(body)))
        if not answer_late and pending and m._charge_in_flight:
            apply(m.on_charge(pending.pop(), exhausted=False))
        start = p
    while pending and m._charge_in_flight:
        apply(m.on_charge(pending.pop(), exhausted=False))
    assert delivered == len(sizes) and m.finished


def test_stream_phase_table_is_total_and_an_ended_stream_stays_ended() -> None:
    """Every (phase, input) pair is listed, in both tables; FINISHED and CUT absorb every
    input; a decided cut is never left but for the cut; UNENFORCED absorbs every input."""
    assert set(STREAM_TRANSITIONS) == {(p, i) for p in StreamPhase for i in StreamInput}
    for ended in (StreamPhase.FINISHED, StreamPhase.CUT):
        assert {STREAM_TRANSITIONS[(ended, i)] for i in StreamInput} == {ended}
    assert STREAM_TRANSITIONS[(StreamPhase.OPEN, StreamInput.CUT)] is StreamPhase.CUT
    for cutting in CUTTING:
        assert {STREAM_TRANSITIONS[(cutting, i)] for i in StreamInput} <= CUTTING
    assert set(ENFORCEMENT_TRANSITIONS) == {(e, i) for e in Enforcement for i in EnforcementInput}
    unenforced = Enforcement.UNENFORCED
    assert {ENFORCEMENT_TRANSITIONS[(unenforced, i)] for i in EnforcementInput} == {unenforced}


@given(
    moves=st.lists(
        st.one_of(
            st.tuples(st.sampled_from(list(StreamInput)), st.sampled_from(list(CutReason))),
            st.sampled_from(list(EnforcementInput)),
            st.just("terminal"),
        ),
        max_size=16,
    )
)
def test_the_phase_moves_by_its_tables_only(
    moves: list[tuple[StreamInput, CutReason] | EnforcementInput | str],
) -> None:
    """Any order of inputs (duplicates, a release or a cut after the end, a second decision):
    the phase goes where its tables say and nowhere else, a reason is set exactly while
    cutting and the first one stands, a cut without a decision names the quota."""
    ph = MeterPhase()
    for move in moves:
        before = ph
        if isinstance(move, tuple):
            inp, reason = move
            ph = ph.move(inp, reason)
            assert ph.stream is STREAM_TRANSITIONS[(before.stream, inp)]
            assert ph.enforcement is before.enforcement
            if before.cut_reason is not None:
                assert ph.cut_reason is before.cut_reason
            elif ph.stream is StreamPhase.CUT:
                assert ph.cut_reason is CutReason.QUOTA_EXHAUSTED
            elif ph.stream in CUTTING:
                assert inp is StreamInput.DECIDE_CUT and ph.cut_reason is reason
        elif isinstance(move, EnforcementInput):
            ph = ph.enforcing(move)
            assert ph.enforcement is ENFORCEMENT_TRANSITIONS[(before.enforcement, move)]
            assert ph.stream is before.stream
        else:
            ph = ph.terminal()
            assert ph.terminal_sent and ph.stream is before.stream
        assert (ph.cut_reason is not None) == (ph.stream in CUTTING)
        if ph == before:
            assert ph is before  # a move that changes nothing keeps the value


# -- the phase and its derived flags -------------------------------------------------------


def _check_flags(m: StreamMeter, before: MeterPhase) -> None:
    """The flags read the phase, and the phase only moves the ways its invariants allow."""
    ph = m.phase
    assert m.finished == (ph.stream in (StreamPhase.FINISHED, StreamPhase.CUT))
    assert m.upstream_done == (ph.stream not in UPSTREAM_OPEN)
    assert m.complete == ph.terminal_sent
    assert m.exhausted == (ph.enforcement is Enforcement.EXHAUSTED)
    assert m.enforce == (ph.enforcement is not Enforcement.UNENFORCED)
    assert m.cut_reason is ph.cut_reason
    assert (ph.cut_reason is not None) == (ph.stream in CUTTING)  # a reason iff cutting
    # moves: an ended stream stays ended; facts once true stay true; the first reason stands
    if before.ended:
        assert ph.stream is before.stream
    if before.stream not in UPSTREAM_OPEN:
        assert ph.stream not in UPSTREAM_OPEN
    if before.terminal_sent:
        assert ph.terminal_sent
    if before.cut_reason is not None:
        assert ph.cut_reason is before.cut_reason
    if before.enforcement is Enforcement.UNENFORCED:
        assert ph.enforcement is Enforcement.UNENFORCED
    if before.enforcement is Enforcement.EXHAUSTED:
        assert ph.enforcement is not Enforcement.ENFORCED


@settings(max_examples=400, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=20),
    cuts=st.lists(st.integers(0, 400), max_size=8),
    every=st.integers(1, 8),
    is_strict=st.booleans(),
    enforce=st.sampled_from([True, True, True, False]),
    lease=st.integers(0, 10),
    data=st.data(),
)
def test_derived_flags_agree_with_the_phase_and_the_bytes(
    sizes: list[int],
    cuts: list[int],
    every: int,
    is_strict: bool,
    enforce: bool,
    lease: int,
    data: st.DataObject,
) -> None:
    """Any events, chunk splits, charge answers (granted in part, exhausted, failed: open or
    closed) and cuts: the flags agree with the phase, the phase moves only forward, and they
    agree with what the steps said and the bytes that passed — ``complete`` once ``[DONE]``
    went out, ``cut_reason`` the first cut a step asked for, ``finished`` once a step ended the
    stream or it was cut, ``exhausted`` only after an answer said so."""
    body = b"".join(ev(" ".join("w" for _ in range(n))) for n in sizes) + DONE
    points = sorted({min(c, len(body)) for c in cuts} | {len(body)})
    m = StreamMeter(
        count=words, every=every, strict=is_strict, enforce=enforce, initial_lease=lease
    )
    forwarded = b""
    first_cut: CutReason | None = None
    ended_by_step = False
    told_exhausted = False
    unenforced = not enforce

    def take(step: Step) -> None:
        nonlocal forwarded, first_cut, ended_by_step
        forwarded += step.forward
        if step.cut_reason is not None and first_cut is None and not ended_by_step:
            first_cut = step.cut_reason
        if step.end_stream:
            assert not ended_by_step, "the stream ended twice"
            ended_by_step = True

    def observe(before: MeterPhase) -> None:
        _check_flags(m, before)
        assert m.complete == (DONE in forwarded)
        assert m.cut_reason is first_cut
        assert m.finished == (ended_by_step or m.phase.stream is StreamPhase.CUT)
        if m.exhausted:
            assert told_exhausted and not unenforced

    def answer() -> None:
        """The limiter answers the charge in flight (or fails)."""
        nonlocal told_exhausted, unenforced
        before = m.phase
        what = data.draw(
            st.sampled_from(["grant", "grant", "part", "exhausted", "exhausted", "open", "closed"])
        )
        asked = m._charge_in_flight
        if what in ("open", "closed"):
            m.on_charge_failed()
            if what == "open":
                unenforced = True
                take(m.stop_enforcing())
            else:
                take(m.fail(CutReason.BACKEND_UNAVAILABLE))
        else:
            granted = asked if what == "grant" else data.draw(st.integers(0, asked))
            exhausted = what == "exhausted"
            told_exhausted |= exhausted or (is_strict and granted < asked)
            room = data.draw(st.none() | st.integers(0, 40))
            take(m.on_charge(granted, exhausted, room))
        observe(before)

    start = 0
    for p in points:
        before = m.phase
        take(m.feed(body[start:p], end=p == len(body)))
        observe(before)
        start = p
        while m._charge_in_flight and data.draw(st.booleans()):
            answer()
        if m.cut_reason is not None and not m.finished:
            before = m.phase
            m.cut(DONE)
            observe(before)
        elif not m.finished and data.draw(st.integers(0, 49)) == 0:  # a shutdown cut
            before = m.phase
            take(m.fail(CutReason.SHUTDOWN))
            m.cut(DONE)
            observe(before)
    while m._charge_in_flight:
        answer()
        if m.cut_reason is not None and not m.finished:
            before = m.phase
            m.cut(DONE)
            observe(before)
    assert m.finished or m.enforce  # only an enforcing meter waits on a charge
    if m.phase.stream is StreamPhase.FINISHED:
        assert forwarded.endswith(DONE) and m.complete


def test_meter_phase_moves() -> None:
    """The phase's own moves: the first cut reason stands, a finished stream is never cut, a
    cut names the quota when nothing was decided, unenforced is never left."""
    open_ = MeterPhase()
    cut = open_.decide_cut(CutReason.SHUTDOWN).move(StreamInput.CUT)
    assert (cut.stream, cut.cut_reason) == (StreamPhase.CUT, CutReason.SHUTDOWN)
    assert cut.decide_cut(CutReason.BACKEND_UNAVAILABLE) is cut  # a late failure after it
    assert open_.move(StreamInput.CUT).cut_reason is CutReason.QUOTA_EXHAUSTED
    done = open_.move(StreamInput.UPSTREAM_END).move(StreamInput.RELEASED)
    assert done.stream is StreamPhase.FINISHED
    assert done.decide_cut(CutReason.BACKEND_UNAVAILABLE) is done  # nothing left to cut
    assert done.move(StreamInput.CUT) is done and done.cut_reason is None
    pending = open_.move(StreamInput.UPSTREAM_END).decide_cut(CutReason.EVENT_TOO_LARGE)
    assert pending.move(StreamInput.RELEASED) is pending  # it ends by the cut decided
    off = open_.exhaust().unenforce()
    assert off.enforcement is Enforcement.UNENFORCED and off.exhaust() is off
    assert open_.unenforce().exhaust().enforcement is Enforcement.UNENFORCED
    assert open_.terminal().terminal_sent and not open_.terminal_sent
