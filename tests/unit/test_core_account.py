"""Unit tests for the per-request TPM account and settlement corrections (extproc.core.account)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.account import RequestAccount
from extproc.core.keys import WindowedBucket, windowed
from extproc.core.rules import Adjustment, Limit, Usage

pytestmark = pytest.mark.unit

RPM = Limit("rpm", 10, 60, "*", "tenant")
TPM_MIN = Limit("tpm", 1000, 60, "*", "tenant")
TPM_HOUR = Limit("tpm", 50_000, 3600, "*", "tenant")


def at(now_ms: int) -> list[WindowedBucket]:
    """The RPM, TPM-minute and TPM-hour buckets of 'acme' at ``now_ms``."""
    return windowed("aq", "acme", "k1", [RPM, TPM_MIN, TPM_HOUR], now_ms)


W0 = at(10_000)  # minute window 0, hour window 0
W1 = at(70_000)  # minute window 1, hour window 0
W2 = at(130_000)  # minute window 2, hour window 0


def out(n: int) -> Usage:
    """``n`` output tokens (every kind counts once on a TPM counter)."""
    return Usage(output=n)


def by_key(adjs: list[Adjustment]) -> dict[str, int]:
    """Adjustment amounts by key (keys must be unique)."""
    out = {a.key: a.amount for a in adjs}
    assert len(out) == len(adjs)
    return out


def test_record_keeps_only_tpm_buckets() -> None:
    """A recorded charge remembers the TPM buckets only."""
    acc = RequestAccount()
    acc.record_output(W0, 100)
    assert acc.total == 100
    assert [(b.metric, units) for b, units in acc.charges] == [("tpm", 100), ("tpm", 100)]


def test_record_ignores_zero_and_no_tpm() -> None:
    """A zero charge, or buckets without a per-token counter, charge no bucket (the tokens
    are still the request's total)."""
    acc = RequestAccount()
    acc.record_output(W0, 0)
    acc.record_output([W0[0]], 50)
    assert acc.charges == []
    assert acc.total == 50


def test_zero_delta_no_adjustments() -> None:
    """When the final total equals what was charged nothing is adjusted."""
    acc = RequestAccount()
    acc.record_output(W0, 100)
    acc.record_output(W1, 30)
    assert acc.adjustments(out(130), W2) == []


def test_shortfall_goes_to_current_window_tpm_keys() -> None:
    """A shortfall is charged to the current window's TPM buckets, not to RPM."""
    acc = RequestAccount()
    acc.record_output(W0, 100)
    adjs = acc.adjustments(out(160), W1)
    assert by_key(adjs) == {W1[1].key: 60, W1[2].key: 60}
    expiry = {a.key: a.expire_at_ms for a in adjs}
    assert expiry[W1[1].key] == W1[1].expire_at_ms
    assert expiry[W1[2].key] == W1[2].expire_at_ms


def test_shortfall_with_no_prior_charge() -> None:
    """A request charged nothing at admission is charged the whole final total now."""
    acc = RequestAccount()
    assert by_key(acc.adjustments(out(25), W0)) == {W0[1].key: 25, W0[2].key: 25}


def test_refund_within_single_charge() -> None:
    """A refund smaller than the only charge goes back to that charge's buckets."""
    acc = RequestAccount()
    acc.record_output(W0, 100)
    assert by_key(acc.adjustments(out(40), W2)) == {W0[1].key: -60, W0[2].key: -60}


def test_refund_newest_charge_first() -> None:
    """A refund is taken from the newest charge first, then older ones."""
    acc = RequestAccount()
    acc.record_output(W0, 100)  # minute 0
    acc.record_output(W1, 30)  # minute 1
    acc.record_output(W2, 20)  # minute 2
    # charged 150, final 90: refund 60 = 20 from minute 2, 30 from minute 1, 10 from minute 0.
    got = by_key(acc.adjustments(out(90), W2))
    assert got == {
        W2[1].key: -20,
        W1[1].key: -30,
        W0[1].key: -10,
        W0[2].key: -60,  # the hour bucket is shared by all three charges: merged
    }


def test_refund_stops_at_newest_when_enough() -> None:
    """A refund covered by the newest charge does not touch older windows."""
    acc = RequestAccount()
    acc.record_output(W0, 100)
    acc.record_output(W1, 30)
    got = by_key(acc.adjustments(out(110), W2))
    assert got == {W1[1].key: -20, W1[2].key: -20}
    assert W0[1].key not in got


def test_refund_never_more_than_charged() -> None:
    """A final total below zero refunds exactly what was charged in each window."""
    acc = RequestAccount()
    acc.record_output(W0, 100)
    acc.record_output(W1, 30)
    got = by_key(acc.adjustments(out(-50), W2))
    assert got == {W0[1].key: -100, W1[1].key: -30, W0[2].key: -130}


def test_same_key_amounts_merged_and_zero_dropped() -> None:
    """Amounts for the same key are merged into one adjustment."""
    acc = RequestAccount()
    acc.record_output(W0, 10)
    acc.record_output(W0, 10)
    adjs = acc.adjustments(out(0), W0)
    assert by_key(adjs) == {W0[1].key: -20, W0[2].key: -20}


@given(
    charges=st.lists(st.tuples(st.sampled_from([0, 1, 2]), st.integers(1, 500)), max_size=8),
    final=st.integers(0, 4000),
)
def test_adjustments_restore_final_total(charges: list[tuple[int, int]], final: int) -> None:
    """Per window, charged + adjustment is never negative and the minute buckets sum to final."""
    windows = [W0, W1, W2]
    acc = RequestAccount()
    per_key: dict[str, int] = {}
    for w, amount in charges:
        acc.record_output(windows[w], amount)
        per_key[windows[w][1].key] = per_key.get(windows[w][1].key, 0) + amount
    adjs = by_key(acc.adjustments(out(final), W2))
    for key, amount in adjs.items():
        if ":60:" in key:
            per_key[key] = per_key.get(key, 0) + amount
    assert all(v >= 0 for v in per_key.values())
    assert sum(per_key.values()) == final
