"""The learned decode rate (pure arithmetic): per model the median of its last WINDOW
observed rates once MIN_SAMPLES were made, the configured rate before; short responses say
nothing; memory stays bounded whatever is observed."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core import decode_rate as dr
from extproc.core.decode_rate import DecodeRates, RateWindow, observed_rate

pytestmark = pytest.mark.unit


def test_the_configured_rate_stands_until_enough_observations() -> None:
    rates = DecodeRates()
    for _ in range(dr.MIN_SAMPLES - 1):
        rates.observe("m", 400, 1, 1000)
    assert rates.rate("m", 200) == 200
    rates.observe("m", 400, 1, 1000)
    assert rates.rate("m", 200) == 400
    assert rates.rate("other", 123) == 123  # per model


def test_short_responses_are_not_observed() -> None:
    assert observed_rate(dr.MIN_TOKENS - 1, 1, 5000) is None
    assert observed_rate(10_000, 1, dr.MIN_MS - 1) is None
    assert observed_rate(2 * dr.MIN_TOKENS, 2, 1000) == pytest.approx(dr.MIN_TOKENS)
    rates = DecodeRates()
    for _ in range(3 * dr.MIN_SAMPLES):
        rates.observe("m", 8, 1, 1000)
    assert rates.samples("m") == 0 and rates.rate("m", 77) == 77


@settings(max_examples=200, deadline=None)
@given(
    obs=st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=50_000),
            st.integers(min_value=1, max_value=8),
            st.integers(min_value=0, max_value=120_000),
        ),
        max_size=3 * dr.WINDOW,
    )
)
def test_the_rate_is_the_median_of_the_last_window(obs: list[tuple[int, int, int]]) -> None:
    rates = DecodeRates()
    for tokens, seqs, ms in obs:
        rates.observe("m", tokens, seqs, ms)
    kept = [r for r in (observed_rate(*o) for o in obs) if r is not None][-dr.WINDOW :]
    assert rates.samples("m") == len(kept) <= dr.WINDOW
    if len(kept) < dr.MIN_SAMPLES:
        assert rates.rate("m", 200) == 200
    else:
        got = rates.rate("m", 200)
        med = statistics.median(kept)
        assert med <= got < med + 1  # rounded up
        assert min(kept) <= got <= max(kept) + 1


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(min_value=0.01, max_value=1e6), min_size=dr.MIN_SAMPLES, max_size=200))
def test_one_outlier_barely_moves_it(values: list[float]) -> None:
    w = RateWindow()
    for v in values:
        w.observe(v)
    before = w.rate()
    w.observe(1e9)
    after = w.rate()
    assert before is not None and after is not None
    kept = sorted([*values, 1e9][-dr.WINDOW :])
    assert after <= kept[len(kept) // 2] + 1  # the median, not the mean


def test_models_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dr, "MAX_MODELS", 3)
    rates = DecodeRates()
    for name in ("a", "b", "c", "d"):
        rates.observe(name, 100, 1, 1000)
    assert rates.samples("a") == 0  # the oldest-observed was forgotten
    assert all(rates.samples(n) == 1 for n in ("b", "c", "d"))
