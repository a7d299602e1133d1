"""The per-request rules of extproc.core.policies, each on its own: fail-open, the settlement
push-back, the cancel of a failed call, the bound's eligibility, the output room a bound
needs, the lease, whether a refusal counts, and the billing record's figures (Hypothesis over
their inputs)."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core import policies
from extproc.core.admission_plan import Cost
from extproc.core.keys import windowed
from extproc.core.rules import RATE_SCALE, Limit, Rates

pytestmark = pytest.mark.unit

TPM = Limit("tpm", 1000, 60, "*", "tenant")


def test_only_open_fails_open() -> None:
    """``open`` lets a request through unmetered when the limiter fails; anything else refuses."""
    assert policies.fails_open("open")
    assert not policies.fails_open("closed")


def test_a_full_settlement_backlog_pushes_back_as_the_plan_fails() -> None:
    """A full settlement backlog admits unmetered under ``open``, refuses under ``closed``."""
    assert policies.unmetered_on_backlog("open")
    assert not policies.unmetered_on_backlog("closed")


def test_a_failed_admission_call_keeps_a_cancel_only_when_it_may_have_run() -> None:
    """A call that timed out may still run: it keeps a cancel; one that failed outright does
    not."""
    assert policies.keeps_cancel(maybe_ran=True)
    assert not policies.keeps_cancel(maybe_ran=False)


@given(
    enabled=st.booleans(),
    proven=st.booleans(),
    bound=st.integers(min_value=0, max_value=10_000),
    cap=st.none() | st.integers(min_value=0, max_value=10_000),
)
def test_a_bound_is_decided_on_only_when_allowed_proven_and_within_the_models_limit(
    enabled: bool, proven: bool, bound: int, cap: int | None
) -> None:
    """Admission decides on a bound only when the setting allows it, the tokenizer's bound is
    proven, and the bound is within the model's input limit."""
    ok = policies.may_admit_on_bound(enabled=enabled, proven_bound=proven) and (
        policies.bound_within(bound, cap)
    )
    assert ok == (enabled and proven and (cap is None or bound <= cap))


def test_a_metered_stream_on_a_bound_needs_room_for_its_whole_output() -> None:
    """A metered stream admitted on a bound needs its whole output's units on each counter;
    a request not metered as it streams needs none."""
    buckets = windowed("aq", "acme", "k1", [TPM], 10_000)
    stream = Cost(
        input_tokens=10,
        effective_max_output=300,
        reserved_output=0,
        meter_stream=True,
        enforce_stream=True,
        strict=False,
        settle_to_actual=True,
        every=4,
    )
    assert policies.output_room_needed(buckets, stream) == {buckets[0].key: 300}
    plain = Cost(
        input_tokens=10,
        effective_max_output=300,
        reserved_output=300,
        meter_stream=False,
        enforce_stream=False,
        strict=False,
        settle_to_actual=True,
        every=4,
    )
    assert policies.output_room_needed(buckets, plain) is None


@given(
    settle=st.booleans(),
    slots=st.booleans(),
    records=st.booleans(),
    lease=st.integers(min_value=1, max_value=600_000),
)
def test_an_admission_is_leased_when_something_must_be_given_back_or_written(
    settle: bool, slots: bool, records: bool, lease: int
) -> None:
    """Leased (for the configured time) exactly when there is a reservation to settle, a slot
    to free or a record to write; else not leased at all."""
    got = policies.lease_ms(
        settle_to_actual=settle, holds_slots=slots, records=records, lease=lease
    )
    assert got == (lease if (settle or slots or records) else 0)


@given(on_bound=st.booleans(), configured=st.booleans())
def test_a_refusal_on_a_bound_never_counts(on_bound: bool, configured: bool) -> None:
    """A refusal counts as configured, except on a bound (asked again on the exact count)."""
    assert policies.counts_refusal(on_bound=on_bound, configured=configured) == (
        configured and not on_bound
    )


figures = st.integers(min_value=0, max_value=100_000)


RPM = Limit("rpm", 60, 60, "*", "tenant")


@given(
    bound=st.integers(min_value=1, max_value=50_000),
    exact=st.integers(min_value=0, max_value=60_000),
    reserved=st.integers(min_value=0, max_value=4_000),
)
def test_the_bound_excess_refund_is_what_admission_charged_beyond_the_exact_input(
    bound: int, exact: int, reserved: int
) -> None:
    """Once the exact input of a request admitted on a bound is known, a reclaim may refund on
    each token counter what admission charged beyond it: the difference of input, never
    negative, nothing at or above the bound, and nothing on request or other counters."""
    buckets = windowed("aq", "acme", "k1", [TPM, RPM], 10_000)
    cost = Cost(
        input_tokens=bound,
        effective_max_output=reserved,
        reserved_output=reserved,
        meter_stream=False,
        enforce_stream=False,
        strict=False,
        settle_to_actual=True,
        every=4,
    )
    refund = policies.bound_excess_refund(buckets, cost, exact)
    if exact >= bound:
        assert refund == ()
    else:
        tpm = next(b for b in buckets if b.kind == "tpm")
        assert refund == ((tpm.key, bound - exact),)


@given(
    draft_input=st.integers(min_value=0, max_value=50_000),
    reserved=st.integers(min_value=0, max_value=4_000),
    streamed=st.integers(min_value=-5_000, max_value=20_000),
    noted=st.integers(min_value=-1, max_value=50_000),
    priced=st.booleans(),
)
def test_a_reclaimed_request_is_billed_its_noted_input_and_its_charged_output(
    draft_input: int, reserved: int, streamed: int, noted: int, priced: bool
) -> None:
    """A request reclaimed from a dead processor is billed the exact input its processor noted
    (else the draft's), the output its ledger charged beyond input and reservation (never
    negative), and the prices of exactly that."""
    charged = max(0, draft_input + reserved + streamed)
    prices = Rates(input=3 * RATE_SCALE, output=5 * RATE_SCALE) if priced else None
    bill = policies.reclaimed_billing(
        charged=charged,
        draft_input=draft_input,
        reserved_output=reserved,
        noted_input=noted,
        prices=prices,
    )
    assert bill.input == (noted if noted >= 0 else draft_input)
    assert bill.output == max(0, charged - draft_input - reserved)
    if prices is None:
        assert bill.money is None
    else:
        assert bill.money == Decimal(3 * bill.input + 5 * bill.output).scaleb(-6)
