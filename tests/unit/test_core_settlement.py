"""The pure settlement planner (extproc.core.settlement): properties over its inputs, whatever
they are: which request is charged nothing, which keeps its admission charge, when the exact
count must come first, and that no plan bills input or output beyond what it may."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.admission_plan import Cost
from extproc.core.apis.base import ParsedRequest
from extproc.core.figures import Figure
from extproc.core.keys import windowed
from extproc.core.lifecycle import Ending
from extproc.core.phase_records import Admitted, Reported, StreamEnd
from extproc.core.rules import RATE_SCALE, Limit, Rates, Usage
from extproc.core.settlement import (
    ABANDONED,
    COUNT_FIRST,
    Basis,
    CountFirst,
    SettleFacts,
    SettlementPlan,
    settle,
    upstream_input,
)

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class FakeModel:
    """A model as settlement reads it (pure logic: a plain value)."""

    name: str = "m"
    known: bool = True
    prices: Rates | None = None
    currency: str = ""
    max_input_tokens: int | None = None
    max_output_tokens: int = 4000
    exact_count: bool = True
    continuous_usage: bool = False
    abandoned_tokens_per_second: int = 200
    exact_non_streams: bool = False
    exact_stream_interval: int | None = None

    def stream_counter(self) -> Callable[[str], int]:
        return len


TPM = Limit("tpm", 100_000, 60, "*", "tenant")
CONC = Limit("concurrency", 5, 0, "*", "tenant")

figures = st.integers(min_value=0, max_value=50_000)
maybe = st.none() | figures


@st.composite
def facts(draw: st.DrawFn) -> SettleFacts:
    """Any request that reaches settlement admitted with counters to settle."""
    bound = draw(st.integers(min_value=1, max_value=20_000))
    reserved = draw(st.integers(min_value=0, max_value=4_000))
    on_bound = draw(st.booleans())
    settle_to_actual = draw(st.booleans()) or on_bound  # a bound is only taken so
    cost = Cost(
        input_tokens=bound,
        effective_max_output=reserved,
        reserved_output=reserved,
        meter_stream=True,
        enforce_stream=True,
        strict=False,
        settle_to_actual=settle_to_actual,
        every=16,
    )
    slots = draw(st.booleans())
    limits = [TPM, CONC] if slots else [TPM]
    buckets = tuple(windowed("aq", "t", "k", limits, 0))
    floor = draw(st.integers(min_value=0, max_value=bound)) if on_bound else 0
    model = FakeModel(exact_count=draw(st.booleans()))
    adm = Admitted(model, cost, buckets, 0, (), input_bound=on_bound, input_floor=floor)
    counted = draw(st.none() | st.integers(min_value=0, max_value=bound)) if on_bound else None
    current = cost if counted is None else replace(cost, input_tokens=counted)
    stream = draw(
        st.none()
        | st.builds(
            StreamEnd,
            counted=figures,
            delivered=st.integers(min_value=0, max_value=max(reserved, 1)),
            complete=st.booleans(),
            cut=st.booleans(),
            text_events=st.integers(min_value=0, max_value=100),
        )
    )
    reported = draw(st.none() | st.builds(Reported, maybe, maybe, figures, figures))
    req = ParsedRequest(
        api="chat",
        model="m",
        stream=stream is not None,
        sequences=draw(st.integers(min_value=1, max_value=4)),
        declared_max_output=reserved,
        body={},
    )
    return SettleFacts(
        ending=draw(st.sampled_from(list(Ending))),
        now_ms=draw(st.integers(min_value=0, max_value=120_000)),
        status=draw(st.sampled_from([None, 200, 204, 400, 429, 500, 503])),
        admitted=adm,
        cost=current,
        counted=counted,
        reported=reported,
        decided_output=None,
        stream=stream,
        req=req,
        charged=draw(st.integers(min_value=0, max_value=bound + reserved + 5_000)),
        uncounted=False,
        shortcut=draw(st.booleans()),
        abandon_rate=draw(st.none() | st.integers(min_value=0, max_value=5_000)),
        abandon_start_ms=draw(st.integers(min_value=0, max_value=2_000)),
        first_chunk_ms=draw(st.integers(min_value=0, max_value=60_000)),
    )


def counted_first(f: SettleFacts) -> SettlementPlan:
    """The plan, the exact count given first when it asks for it (the count is the bound's
    floor here: any value in the proven range)."""
    plan = settle(f)
    if isinstance(plan, CountFirst):
        exact = max(1, f.admitted.input_floor)
        plan = settle(replace(f, counted=exact, cost=replace(f.cost, input_tokens=exact)))
    assert isinstance(plan, SettlementPlan)
    return plan


@given(f=facts())
def test_planning_is_pure(f: SettleFacts) -> None:
    """The same facts give the same plan, every time."""
    assert settle(f) == settle(f)


@given(f=facts())
def test_the_count_comes_first_only_when_a_figure_needs_it(f: SettleFacts) -> None:
    """The planner never counts: it asks, and only for a 2xx request settled to actual figures
    and admitted on a bound that was not counted, with no upstream figure in the proven range."""
    plan = settle(f)
    asks = isinstance(plan, CountFirst)
    if asks:
        assert plan is COUNT_FIRST
        assert f.admitted.input_bound and f.counted is None
        assert f.cost.settle_to_actual
        assert f.status is None or 200 <= f.status < 300
        assert upstream_input(f.admitted, f.counted, f.reported) is None
    if f.counted is not None or not f.admitted.input_bound:
        assert not asks


@given(f=facts())
def test_each_basis_bills_what_its_rule_says(f: SettleFacts) -> None:
    """Nothing for a non-2xx answer; the admission's charge for a plan final at admission; the
    input and output figures when the output is known; else the reservation, its input
    corrected to the count."""
    plan = counted_first(f)
    assert plan.calls_limiter == (
        plan.corrects or any(b.kind == "concurrency" for b in f.admitted.buckets)
    )
    assert plan.delta == plan.total - f.charged
    if f.status is not None and not 200 <= f.status < 300:
        assert plan.basis is Basis.NOTHING
        assert (plan.total, plan.input, plan.output, plan.usage) == (0, 0, 0, Usage())
        assert plan.corrects
    elif not f.cost.settle_to_actual:
        assert plan.basis is Basis.FINAL_AT_ADMISSION
        assert not plan.corrects and plan.total == f.charged and plan.delta == 0
        assert plan.output is None and plan.audit is None
    elif plan.basis is Basis.ACTUAL:
        assert plan.output is not None and plan.corrects
        assert plan.total == plan.input + plan.output
        assert plan.usage.input == plan.input and plan.usage.output == plan.output
        assert plan.usage.cached_input <= plan.input and plan.usage.reasoning <= plan.output
    else:
        assert plan.basis is Basis.RESERVATION and plan.output is None
        charged_in = f.admitted.cost.input_tokens if f.admitted.cost else 0
        assert plan.corrects == (plan.input != charged_in)
        rest = max(0, f.charged - charged_in)
        assert plan.total == (plan.input + rest if plan.corrects else f.charged)


@given(f=facts())
def test_output_is_never_billed_beyond_its_bounds(f: SettleFacts) -> None:
    """A cut or incomplete stream is billed what was delivered; an abandoned request never more
    than was reserved; a completed stream's figure within the recount's bounds and the budget."""
    plan = counted_first(f)
    if plan.basis is not Basis.ACTUAL:
        return
    assert plan.output is not None
    end = f.stream
    if end is not None and (end.cut or not end.complete or f.reported is None):
        assert plan.output == end.delivered
    elif (
        end is None and f.ending in ABANDONED and (f.reported is None or f.reported.output is None)
    ):
        assert plan.output <= f.cost.reserved_output
    elif end is not None and f.reported is not None and f.reported.output is not None:
        assert isinstance(plan.output_figure, Figure)
        assert plan.output <= max(f.cost.effective_max_output, 0) or plan.output == 0


@given(f=facts())
def test_an_input_billed_without_a_count_lies_in_the_proven_range(f: SettleFacts) -> None:
    """The upstream's input figure stands without a count only for a prompt admitted on a bound,
    within [the bound's floor, the bound]; it is then audited as such (when the model has the
    shortcut)."""
    plan = counted_first(f)
    if plan.uncounted:
        adm = f.admitted
        assert adm.input_bound and adm.cost is not None
        assert f.reported is not None and f.reported.input is not None
        assert max(1, adm.input_floor) <= f.reported.input <= adm.cost.input_tokens
        if plan.basis in (Basis.ACTUAL, Basis.RESERVATION):
            assert plan.input == f.reported.input
        if f.shortcut and plan.audit is not None:
            assert plan.audit.verdict == "uncounted" and plan.audit.check == "uncounted"


@given(f=facts())
def test_the_bill_never_exceeds_the_charge(f: SettleFacts) -> None:
    """The usage record's input is at most what the counters hold."""
    plan = counted_first(f)
    prices = Rates(input=2 * RATE_SCALE, output=3 * RATE_SCALE, request=0)
    got = plan.billed(1, prices)
    assert 0 <= got.input <= max(0, plan.total)
    assert got.money is not None and got.money >= 0


@given(
    charged=st.integers(min_value=-1000, max_value=200_000),
    corrects=st.booleans(),
    inp=figures,
    out=maybe,
    priced=st.booleans(),
)
def test_the_billing_record_never_bills_more_input_than_was_charged(
    charged: int, corrects: bool, inp: int, out: int | None, priced: bool
) -> None:
    """The record's input is within what was charged (none when nothing was), its output the
    settled figure or the rest of the charge, and its money the prices of what it bills."""
    usage = Usage(input=inp, output=out or 0, requests=1)
    prices = Rates(input=2 * RATE_SCALE, output=3 * RATE_SCALE, request=0) if priced else None
    plan = SettlementPlan(
        ending=Ending.COMPLETED,
        basis=Basis.ACTUAL if corrects else Basis.FINAL_AT_ADMISSION,
        input=inp,
        output=out,
        usage=usage,
        total=charged,
        corrects=corrects,
        charged=charged,
        holds_slots=False,
        output_figure=None,
        input_figure=None,
        adopt_input=None,
        uncounted=False,
        audit=None,
        decode=None,
    )
    got = plan.billed(1, prices)
    assert 0 <= got.input <= max(0, charged)
    assert got.input <= inp
    if out is not None:
        assert got.output == out
    else:
        assert got.output == max(0, charged - got.input)
    if prices is None:
        assert got.money is None
    elif charged <= 0:
        assert got.money == Decimal(0)
    elif corrects:
        assert got.money == Decimal(prices.units(usage)).scaleb(-6)
    else:
        billed = Usage(input=got.input, output=got.output, requests=1)
        assert got.money == Decimal(prices.units(billed)).scaleb(-6)
