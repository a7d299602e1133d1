"""The admission machine's wait state (docs/semantics.md, "Waiting"): a plan that waits gives
its call a queue; an answer with a ticket moves to AWAITING_TURN with a Wait out; the turn asks
the same plan again (the deadline still counted from the first call); a cancel there leaves
the queue and keeps nothing else; the replica's cap asks once more with no wait left; the
admitted request carries x-ratelimit-waited-ms and its record the wait; a refusal says when
its turn would have been."""

from __future__ import annotations

from dataclasses import replace

import pytest

from extproc.config import load_config_text
from extproc.core.admission_flow import Admission, AdmissionState
from extproc.core.admission_vocabulary import (
    AdmissionAction,
    AdmitAnswered,
    AdmitCancelled,
    BodyArrived,
    CallAdmit,
    CountExact,
    ForwardBody,
    InputCounted,
    KeepCancel,
    LeaveQueue,
    Reject,
    TurnCame,
    Wait,
    WaitDeclined,
    WaitOver,
)
from extproc.core.phase_records import PhaseError
from extproc.core.waiting import WaitRule
from extproc.errors import QuotaExceeded
from tests.unit.test_core_admission_flow import BODY, EXACT, Room, admission_of, config, session

pytestmark = pytest.mark.unit

S = AdmissionState


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000

    def __call__(self) -> int:
        return self.now


def waiting() -> tuple[Admission, Clock]:
    cfg = replace(config(on_bound=False), key_waits={("t", "k"): WaitRule(15_000)})
    s = session(cfg)
    clock = Clock()
    adm = Admission(s, cfg, key_prefix="aiq", room=Room(True), records=True, now_ms=clock)
    return adm, clock


def first_call(adm: Admission) -> CallAdmit:
    out = adm.handle(BodyArrived(BODY))
    assert isinstance(out[-1], CountExact)
    out = adm.handle(InputCounted(EXACT))
    call = out[-1]
    assert isinstance(call, CallAdmit) and call.queue is not None
    return call


def ticket(call: CallAdmit, turn: int) -> AdmitAnswered:
    return AdmitAnswered(False, False, tuple(c.amount for c in call.charges), True, turn)


def last(out: list[AdmissionAction]) -> AdmissionAction:
    return out[-1]


def test_a_ticket_waits_for_its_turn_then_asks_again() -> None:
    adm, clock = waiting()
    call = first_call(adm)
    assert call.queue is not None and call.queue.deadline_ms == clock.now + 15_000
    out = adm.handle(ticket(call, clock.now + 4000))
    w = last(out)
    assert isinstance(w, Wait) and w.first and w.until_ms == clock.now + 4000
    assert adm.state is S.AWAITING_TURN
    with pytest.raises(PhaseError):  # nothing but the turn, the cap or a cancel
        adm.handle(InputCounted(EXACT))
    arrival = clock.now
    clock.now += 4000
    again = last(adm.handle(TurnCame()))
    assert isinstance(again, CallAdmit) and again.queue is not None
    assert again.now_ms == clock.now and again.queue.deadline_ms == arrival + 15_000
    done = adm.handle(AdmitAnswered(True, False, tuple(c.amount for c in again.charges)))
    assert isinstance(last(done), ForwardBody)
    assert WaitOver("admitted", 4000) in done
    rec = adm.s.admitted
    assert rec is not None and rec.waited_ms == 4000
    assert ("x-ratelimit-waited-ms", "4000") in rec.headers


def test_a_cancel_while_waiting_leaves_the_queue_and_keeps_nothing() -> None:
    adm, clock = waiting()
    call = first_call(adm)
    adm.handle(ticket(call, clock.now + 4000))
    out = adm.handle(AdmitCancelled())
    assert adm.state is S.DONE
    assert [type(a) for a in out] == [LeaveQueue]
    assert not any(isinstance(a, KeepCancel) for a in out)


def test_a_cancel_with_the_call_out_keeps_its_undo_and_leaves() -> None:
    adm, _ = waiting()
    first_call(adm)
    out = adm.handle(AdmitCancelled())
    assert [type(a) for a in out] == [KeepCancel, LeaveQueue]


def test_the_replicas_cap_asks_once_more_with_no_wait_left() -> None:
    adm, clock = waiting()
    call = first_call(adm)
    adm.handle(ticket(call, clock.now + 4000))
    again = last(adm.handle(WaitDeclined()))
    assert isinstance(again, CallAdmit) and again.queue is not None
    assert again.queue.deadline_ms == clock.now  # refused at once unless there is room now
    refused = AdmitAnswered(
        False, False, tuple(c.limit for c in again.charges), False, clock.now + 4000
    )
    out = adm.handle(refused)
    rej = last(out)
    assert isinstance(rej, Reject) and isinstance(rej.error, QuotaExceeded)
    assert rej.error.retry_after_s == 4.0
    assert "holds its most waiting requests" in rej.error.message
    assert any(isinstance(a, WaitOver) and a.outcome == "replica_full" for a in out)


def test_a_drain_before_the_turn_asks_once_more_and_tells_the_turn() -> None:
    adm, clock = waiting()
    call = first_call(adm)
    adm.handle(ticket(call, clock.now + 9000))
    clock.now += 2500  # the drain starts 2.5 s into the wait, its grace ends before the turn
    again = last(adm.handle(WaitDeclined("draining")))
    assert isinstance(again, CallAdmit) and again.queue is not None
    assert again.queue.deadline_ms == clock.now  # admitted only if there is room now
    full = tuple(c.limit for c in again.charges)
    out = adm.handle(AdmitAnswered(False, False, full, False, clock.now + 6500))
    rej = last(out)
    assert isinstance(rej, Reject) and isinstance(rej.error, QuotaExceeded)
    assert rej.error.retry_after_s == 6.5  # its turn, for a retry on another replica
    assert "after waiting 2.500s" in rej.error.message
    assert "shutting down before its turn" in rej.error.message
    assert ("x-ratelimit-waited-ms", "2500") in rej.error.headers.as_pairs()
    assert WaitOver("draining", 2500) in out
    assert adm.state is S.DONE


def test_a_drain_that_finds_room_admits_at_once() -> None:
    adm, clock = waiting()
    call = first_call(adm)
    adm.handle(ticket(call, clock.now + 9000))
    clock.now += 1000
    again = last(adm.handle(WaitDeclined("draining")))
    assert isinstance(again, CallAdmit)
    out = adm.handle(AdmitAnswered(True, False, tuple(c.limit for c in again.charges), False, 0))
    assert isinstance(last(out), ForwardBody)
    assert WaitOver("admitted", 1000) in out


def test_an_unservable_request_is_told_its_turn() -> None:
    adm, clock = waiting()
    call = first_call(adm)
    full = tuple(c.limit for c in call.charges)
    out = adm.handle(AdmitAnswered(False, False, full, False, clock.now + 19_500))
    rej = last(out)
    assert isinstance(rej, Reject) and isinstance(rej.error, QuotaExceeded)
    assert rej.error.retry_after_s == 19.5
    assert "beyond the plan's maximum wait" in rej.error.message
    assert ("x-ratelimit-waited-ms", "0") in rej.error.headers.as_pairs()
    assert WaitOver("unservable", 0) in out


def test_a_plan_that_does_not_wait_gives_no_queue() -> None:
    cfg = config(on_bound=False)
    adm = admission_of(cfg, session(cfg))
    adm.handle(BodyArrived(BODY))
    call = last(adm.handle(InputCounted(EXACT)))
    assert isinstance(call, CallAdmit) and call.queue is None


def test_a_keys_own_wait_is_over_its_plans() -> None:
    cfg = load_config_text(
        """
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 100}
plans:
  p: {limits: [{per: 10s, rpm: 2}], wait: {max_seconds: 15}}
  q: {limits: [{per: 10s, rpm: 2}]}
tenants:
  a:
    plan: p
    keys: [{name: a1, plaintext: sk-a1, wait: {max_seconds: 3}}, {name: a2, plaintext: sk-a2}]
  b:
    plan: q
    keys: [{name: b1, plaintext: sk-b1, wait: {max_seconds: 5, priority: 2}}, {name: b2, plaintext: sk-b2}]
"""
    )
    assert cfg.wait_for("p", "a", "a1") == WaitRule(3000, boost_ms=5000)
    assert cfg.wait_for("p", "a", "a2") == WaitRule(15_000, boost_ms=5000)
    b1 = cfg.wait_for("q", "b", "b1")
    assert b1 is not None and b1.max_ms == 5000 and b1.priority == 2
    assert cfg.wait_for("q", "b", "b2") is None  # its plan does not wait
