"""The admission flow of extproc.core.admission_flow, driven by events alone (no server, no limiter):
Hypothesis over the limiter's answers (admitted, refused by a limit on the model or by a
tenant-wide one, duplicate, failed with or without ``maybe_ran``, cancelled, pushed back by
the settlement backlog), a bound eligible or not, a fallback configured or not, the plan
failing open or closed, and refusals counting or not."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.config import load_config_text
from extproc.config.runtime import RuntimeConfig
from extproc.core.admission_flow import Admission
from extproc.core.admission_rules import bound_input
from extproc.core.admission_vocabulary import (
    AdmissionAction,
    AdmissionEvent,
    AdmitAnswered,
    AdmitBacklogged,
    AdmitCancelled,
    AdmitError,
    AdmitFailed,
    Attempting,
    CallAdmit,
    CountExact,
    Decided,
    FellBack,
    ForwardBody,
    InputAdmission,
    InputCounted,
    KeepCancel,
    LimitDecisions,
    PushedBack,
    Reject,
)
from extproc.core.apis.openai import CHAT
from extproc.core.counters import UTF8BoundCounter
from extproc.core.lifecycle import Input
from extproc.core.phase_records import Identified, PhaseError
from extproc.core.room_hints import RoomHints
from extproc.core.rules import BucketCharge, Charging
from extproc.core.session import Session
from extproc.errors import LimiterUnavailable, QuotaExceeded, RequestTooLarge, UnknownModel

pytestmark = pytest.mark.unit

RULES = """
models:
  big: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 100}
  small: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 100}
plans:
  p:
    limits:
      - {model: "*", per: hour, rpm: 1000, tpm: 1000000}
      - {model: big, per: hour, tpm: 5000}
tenants:
  t: {plan: p, keys: [{name: k, plaintext: sk-t}]}
"""
BASE = load_config_text(RULES)
BODY = (
    b'{"model": "big", "max_tokens": 50, "stream": false, '
    b'"messages": [{"role": "user", "content": "Say hello to the world, politely."}]}'
)
EXACT = 17  # what the scripted counter answers (below the bound: a bound is an over-count)


class Room(RoomHints):
    """The counters' last seen values, as a yes or a no."""

    __slots__ = ("yes",)

    def __init__(self, yes: bool) -> None:
        super().__init__()
        self.yes = yes

    def ample(
        self,
        charges: list[BucketCharge],
        headroom: float,
        then: dict[str, int] | None = None,
        *,
        share: float = 1.0,
    ) -> bool:
        return self.yes


def config(
    *, fallback: bool = False, fail_open: bool = False, on_bound: bool = True, count: bool = False
) -> RuntimeConfig:
    return replace(
        BASE,
        fallbacks={"p": {"big": "small"}} if fallback else {},
        plan_failure_modes={"p": "open" if fail_open else "closed"},
        admit_on_bound=on_bound,
        count_refused_requests=count,
        charging={**BASE.charging, ("p", "big"): Charging(mode="stream_incremental")},
    )


def session(cfg: RuntimeConfig) -> Session:
    s = Session()
    s.life.advance(Input.REQUEST_HEADERS)
    key = next(iter(cfg.keys_by_digest.values()))
    s.identify(Identified("r1", "/v1/chat/completions", CHAT, key, cfg.tenants["t"], "led"))
    return s


def admission_of(cfg: RuntimeConfig, s: Session, *, room: bool = True) -> Admission:
    return Admission(s, cfg, key_prefix="aiq", room=Room(room), records=True, now_ms=lambda: 1000)


#: One scripted answer to an admission call.
Answer = str
ANSWERS = ("admitted", "refused_model", "refused_tenant", "duplicate", "failed", "timed_out")
ENDINGS = ("cancelled", "backlogged")


def answer_event(call: CallAdmit, answer: Answer) -> AdmissionEvent:
    """The event for ``answer`` to ``call`` (a refusal fills the bucket that refuses)."""
    values: list[int] = []
    for b, c in zip(call.buckets, call.charges, strict=True):
        full = (answer == "refused_model" and b.limit.model != "*") or (
            answer == "refused_tenant" and b.limit.model == "*" and b.kind == "tpm"
        )
        values.append(b.limit.limit if full else c.amount)
    if answer in ("admitted", "duplicate"):
        return AdmitAnswered(answer == "admitted", answer == "duplicate", tuple(values))
    if answer.startswith("refused"):
        return AdmitAnswered(False, False, tuple(values))
    if answer == "failed":
        return AdmitFailed(LimiterUnavailable("down"))
    if answer == "timed_out":
        return AdmitFailed(LimiterUnavailable("slow", maybe_ran=True))
    if answer == "cancelled":
        return AdmitCancelled()
    return AdmitBacklogged()


@dataclass
class Run:
    """Everything one admission did: each step's actions and the events it was fed."""

    steps: list[list[AdmissionAction]] = field(default_factory=list)
    fed: list[AdmissionEvent] = field(default_factory=list)
    # each call, its answer, its attempt (1: the requested model) and the step it ended
    calls: list[tuple[CallAdmit, Answer, int, int]] = field(default_factory=list)

    @property
    def actions(self) -> list[AdmissionAction]:
        return [a for step in self.steps for a in step]

    def of(self, kind: type[AdmissionAction]) -> list[AdmissionAction]:
        return [a for a in self.actions if isinstance(a, kind)]


def drive(adm: Admission, answers: Iterator[Answer], raw: bytes = BODY) -> Run:
    """Feed the admission the scripted answers until it ends."""
    run = Run()
    actions = adm.body(raw)
    for _ in range(20):  # bounded: an admission asks at most four times
        run.steps.append(actions)
        last = actions[-1] if actions else None
        if isinstance(last, CountExact):
            ev: AdmissionEvent = InputCounted(EXACT)
        elif isinstance(last, CallAdmit):
            answer = next(answers)
            attempt = sum(isinstance(a, Attempting) for a in run.actions)
            run.calls.append((last, answer, attempt, len(run.steps) - 1))
            ev = answer_event(last, answer)
        else:
            return run
        run.fed.append(ev)
        actions = adm.handle(ev)
    raise AssertionError("the admission never ended")


answers_st = st.lists(st.sampled_from(ANSWERS), min_size=4, max_size=4).flatmap(
    lambda xs: st.sampled_from((None, *ENDINGS)).map(lambda end: (xs, end))
)


@settings(max_examples=300, deadline=None)
@given(
    script=answers_st,
    end_at=st.integers(0, 3),
    fallback=st.booleans(),
    fail_open=st.booleans(),
    on_bound=st.booleans(),
    room=st.booleans(),
    count=st.booleans(),
)
def test_admission_invariants(
    script: tuple[list[Answer], str | None],
    end_at: int,
    fallback: bool,
    fail_open: bool,
    on_bound: bool,
    room: bool,
    count: bool,
) -> None:
    """Whatever the limiter answers: the flow ends once (forward or reject, or a cancel kept);
    at most one admission charges; a refused bound is asked again on the exact count; a failure
    fails open iff the plan says so; a cancel is kept whenever the call may have run; the
    fallback is tried only on a refusal by the requested model's limit; the body is parsed
    once and the admitted record names the model served."""
    answers, ending = script
    scripted = list(answers)
    if ending is not None:
        scripted.insert(end_at, ending)
    cfg = config(fallback=fallback, fail_open=fail_open, on_bound=on_bound, count=count)
    s = session(cfg)
    run = drive(admission_of(cfg, s, room=room), iter(scripted))
    acts = run.actions
    last = acts[-1]
    bounded = on_bound and room

    # the flow ends once: forward, reject, or (cancelled) the cancel kept and nothing after
    terminal = [a for a in acts if isinstance(a, ForwardBody | Reject)]
    cancelled = any(isinstance(e, AdmitCancelled) for e in run.fed)
    if cancelled:
        assert not terminal and isinstance(last, KeepCancel)
    else:
        assert terminal == [last]
    assert s.parsed is not None and s.parsed.model.name == "big"

    # at most one admission charged, and nothing is asked after it
    charged = [i for i, (_, a, _, _) in enumerate(run.calls) if a in ("admitted", "duplicate")]
    assert len(charged) <= 1
    if charged:
        assert charged[0] == len(run.calls) - 1
        assert isinstance(last, ForwardBody)
        assert s.admitted is not None and s.cost is not None

    # each attempt asks first on the bound when eligible (its refusal not counted), then on
    # the exact count; a refused bound is always asked again on the exact count
    for i, (call, answer, attempt, at) in enumerate(run.calls):
        on_bound = call.tpm_charged != EXACT + 50
        first_of_attempt = i == 0 or run.calls[i - 1][2] != attempt
        assert on_bound == (bounded and first_of_attempt)
        assert call.count_refused == (count and not on_bound)
        if on_bound:
            assert call.tpm_charged > EXACT + 50  # the bound, above the exact count
        if on_bound and answer.startswith("refused"):
            assert InputAdmission("recounted") in run.steps[at + 1]
            assert isinstance(run.steps[at + 1][-1], CountExact)
            nxt = run.steps[at + 2][-1]
            assert isinstance(nxt, CallAdmit) and nxt.tpm_charged == EXACT + 50

    # a failure fails open iff the plan's failure mode says so
    for _, answer, _, at in run.calls:
        if answer in ("failed", "timed_out"):
            step = run.steps[at + 1]
            assert AdmitError(fail_open) in step
            if fail_open:
                assert isinstance(last, ForwardBody) and s.admitted is not None
                assert s.cost is None  # unmetered
            else:
                assert isinstance(last, Reject) and isinstance(last.error, LimiterUnavailable)
            # a cancel is kept whenever the call may have run (and only then)
            assert any(isinstance(a, KeepCancel) for a in step) == (answer == "timed_out")
            break
    if any(isinstance(e, AdmitBacklogged) for e in run.fed):
        assert PushedBack(fail_open) in acts
        assert not run.of(KeepCancel)
        assert isinstance(last, ForwardBody if fail_open else Reject)
    if cancelled:
        call = run.calls[-1][0]
        undo = last
        assert isinstance(undo, KeepCancel)
        assert [(u.key, -u.amount) for u in undo.undo] == [
            (c.key, c.amount) for c in call.charges if c.kind != "concurrency" and c.amount
        ]

    # the fallback only on an exact refusal by a limit on the requested model
    attempts = [a for a in acts if isinstance(a, Attempting)]
    assert attempts[0] == Attempting("t", "big")
    if len(attempts) > 1:
        assert fallback and attempts[1] == Attempting("t", "small") and len(attempts) == 2
        # what ended the first attempt: its exact call, refused by the requested model's limit
        ended_first = [(c, a) for c, a, n, _ in run.calls if n == 1][-1]
        assert ended_first[0].tpm_charged == EXACT + 50 and ended_first[1] == "refused_model"
    else:
        refused_exact = [
            a for c, a, _, _ in run.calls if a.startswith("refused") and c.tpm_charged == EXACT + 50
        ]
        if refused_exact:
            assert not fallback or refused_exact[0] == "refused_tenant"
            assert isinstance(last, Reject) and isinstance(last.error, QuotaExceeded)
    fell_back = run.of(FellBack)
    if fell_back:
        assert isinstance(last, ForwardBody) and s.admitted is not None
        assert s.admitted.model.name == "small" and s.model is not None
        assert s.model.name == "small"
        assert ("x-aiquota-fallback-model", "small") in s.admitted.headers
        assert LimitDecisions((("tpm", "fallback"),)) in acts
    elif s.admitted is not None:
        assert s.admitted.model.name == "big"
    if isinstance(last, Reject) and isinstance(last.error, QuotaExceeded):
        # the requested model's refusal, fallback or not, reported under it
        assert s.model is not None and s.model.name == "big"
        if len(attempts) > 1:
            assert "model big" in last.error.message
    if isinstance(last, Reject) and isinstance(last.error, LimiterUnavailable):
        # an error on the fallback's way is reported under the fallback (as before the
        # request was parsed once)
        assert s.model is not None and s.model.name == ("small" if len(attempts) > 1 else "big")
    if isinstance(last, ForwardBody):
        assert run.of(Decided)


def test_a_bound_that_has_room_is_admitted_without_counting() -> None:
    """The bound admitted: no count asked, the record says so and holds the bound."""
    cfg = config()
    s = session(cfg)
    run = drive(admission_of(cfg, s), iter(["admitted"]))
    assert not run.of(CountExact) and InputAdmission("bound") in run.actions
    assert s.admitted is not None and s.admitted.input_bound and s.cost is not None
    assert s.parsed is not None
    model = cfg.models["big"]
    bound = bound_input(CHAT, s.parsed.req, model)
    assert bound is not None and s.cost.input_tokens == bound > EXACT
    counter = model.bound_counter
    assert isinstance(counter, UTF8BoundCounter)
    assert s.admitted.input_floor == counter.fewest_tokens(s.cost.input_tokens)


def test_far_from_room_the_input_is_counted_first() -> None:
    """Counters without ample room: the exact count comes first."""
    cfg = config()
    s = session(cfg)
    adm = admission_of(cfg, s, room=False)
    first = adm.body(BODY)
    assert InputAdmission("exact") in first and isinstance(first[-1], CountExact)
    assert first[-1].model.name == "big" and first[-1].size == len(BODY)
    call = adm.handle(InputCounted(EXACT))[-1]
    assert isinstance(call, CallAdmit) and call.tpm_charged == EXACT + 50
    assert call.draft is not None and call.draft.input_tokens == EXACT


def test_client_errors_are_rejections() -> None:
    """A body over the limit, an unknown model: rejected before any call."""
    cfg = config()
    out = admission_of(cfg, session(cfg)).body(b"x" * (cfg.max_body_bytes + 1))
    assert len(out) == 1 and isinstance(out[0], Reject)
    assert isinstance(out[0].error, RequestTooLarge)
    unknown = replace(cfg, unknown_model_action="reject")
    out = admission_of(unknown, session(unknown)).body(BODY.replace(b'"big"', b'"nope"'))
    assert len(out) == 1 and isinstance(out[0], Reject)
    assert isinstance(out[0].error, UnknownModel)


def test_an_answer_out_of_turn_is_a_phase_error() -> None:
    """Feeding an admission that is not waiting is a protocol error, not a silent no-op; a
    body is parsed once."""
    cfg = config()
    s = session(cfg)
    adm = admission_of(cfg, s)
    with pytest.raises(PhaseError):
        adm.handle(InputCounted(3))
    drive(adm, iter(["admitted"]))
    with pytest.raises(PhaseError, match="started twice"):
        adm.body(BODY)
    with pytest.raises(PhaseError, match="started twice"):
        adm.rpm_only()
    assert s.parsed is not None
    with pytest.raises(PhaseError):
        s.parse(s.parsed)


@given(
    answer=st.sampled_from(("admitted", "refused_tenant", "failed", "timed_out", "backlogged")),
    fail_open=st.booleans(),
    count=st.booleans(),
)
def test_rpm_only_is_one_call_on_the_rpm_buckets(answer: str, fail_open: bool, count: bool) -> None:
    """An ``rpm_only`` path: one call on the tenant-wide RPM buckets, refused with a 429, a
    failure failing open or closed as the plan says."""
    cfg = config(fail_open=fail_open, count=count)
    adm = admission_of(cfg, session(cfg))
    first = adm.rpm_only()
    call = first[-1]
    assert isinstance(call, CallAdmit) and {b.kind for b in call.buckets} == {"rpm"}
    assert call.count_refused == count and call.draft is None and call.lease_until_ms == 0
    values = tuple(b.limit.limit for b in call.buckets)
    ev: AdmissionEvent
    if answer == "refused_tenant":
        ev = AdmitAnswered(False, False, values)
    else:
        ev = answer_event(call, answer)
    out = adm.handle(ev)
    if answer == "admitted":
        assert out == []
    elif answer == "refused_tenant":
        assert isinstance(out[-1], Reject) and isinstance(out[-1].error, QuotaExceeded)
    elif fail_open:
        assert not any(isinstance(a, Reject) for a in out)
    else:
        assert isinstance(out[-1], Reject) and isinstance(out[-1].error, LimiterUnavailable)
