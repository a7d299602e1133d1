"""The learned decode rate (pure arithmetic): per model the median of its last WINDOW
observed rates and the shortest of its times to start once MIN_SAMPLES were made, the configured rate with no
start before; short responses say nothing; memory stays bounded whatever is observed; an
abandon is billed the rate times the time after the start, never more than reserved."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core import decode_rate as dr
from extproc.core.admission_plan import Cost
from extproc.core.decode_rate import DecodeRates, RateWindow, observed_rate
from extproc.core.figures import abandoned_output

pytestmark = pytest.mark.unit


def test_the_configured_rate_stands_until_enough_observations() -> None:
    rates = DecodeRates()
    for _ in range(dr.MIN_SAMPLES - 1):
        rates.observe("m", 400, 1, 1000, 120)
    assert rates.abandon("m", 200) == (200, 0)
    rates.observe("m", 400, 1, 1000, 120)
    assert rates.abandon("m", 200) == (400, 120)
    assert rates.rate("m", 200) == 400
    assert rates.abandon("other", 123) == (123, 0)  # per model


def test_short_responses_are_not_observed() -> None:
    assert observed_rate(dr.MIN_TOKENS - 1, 1, 5000) is None
    assert observed_rate(10_000, 1, dr.MIN_MS - 1) is None
    assert observed_rate(2 * dr.MIN_TOKENS, 2, 1000) == pytest.approx(dr.MIN_TOKENS)
    rates = DecodeRates()
    for _ in range(3 * dr.MIN_SAMPLES):
        rates.observe("m", 8, 1, 1000)
    assert rates.samples("m") == 0 and rates.rate("m", 77) == 77


obs_st = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=50_000),
        st.integers(min_value=1, max_value=8),
        st.integers(min_value=0, max_value=120_000),
        st.integers(min_value=0, max_value=5_000),
    ),
    max_size=4 * dr.WINDOW,
)


@settings(max_examples=200, deadline=None)
@given(obs=obs_st)
def test_the_rate_is_the_median_and_the_start_the_shortest_of_the_last_window(
    obs: list[tuple[int, int, int, int]],
) -> None:
    rates = DecodeRates()
    for tokens, seqs, ms, start in obs:
        rates.observe("m", tokens, seqs, ms, start)
    kept = [(observed_rate(t, q, m), s) for t, q, m, s in obs]
    window = [(r, s) for r, s in kept if r is not None][-dr.WINDOW :]
    assert rates.samples("m") == len(window) <= dr.WINDOW
    rate, start = rates.abandon("m", 200)
    if len(window) < dr.MIN_SAMPLES:
        assert (rate, start) == (200, 0)
    else:
        med = statistics.median(r for r, _ in window)
        assert med <= rate < med + 1  # rounded up
        assert start == int(min(s for _, s in window))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(min_value=0.01, max_value=1e6), min_size=dr.MIN_SAMPLES, max_size=200))
def test_one_outlier_barely_moves_it(values: list[float]) -> None:
    w = RateWindow()
    for v in values:
        w.observe(v)
    w.observe(1e9)
    after = w.rate()
    assert after is not None
    kept = sorted([*values, 1e9][-dr.WINDOW :])
    assert after <= kept[len(kept) // 2] + 1  # the median, not the mean


def test_models_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dr, "MAX_MODELS", 3)
    rates = DecodeRates()
    for name in ("a", "b", "c", "d"):
        rates.observe(name, 100, 1, 1000)
    assert rates.samples("a") == 0  # the oldest-observed was forgotten
    assert all(rates.samples(n) == 1 for n in ("b", "c", "d"))


def cost(reserved: int) -> Cost:
    return Cost(
        input_tokens=10,
        effective_max_output=reserved,
        reserved_output=reserved,
        meter_stream=False,
        enforce_stream=False,
        strict=False,
        settle_to_actual=True,
        every=16,
    )


@settings(max_examples=200, deadline=None)
@given(
    rate=st.integers(min_value=0, max_value=5000),
    start=st.integers(min_value=0, max_value=2000),
    elapsed=st.integers(min_value=0, max_value=60_000),
    seqs=st.integers(min_value=1, max_value=8),
    reserved=st.integers(min_value=0, max_value=100_000),
)
def test_an_abandon_bills_the_rate_after_the_start(
    rate: int, start: int, elapsed: int, seqs: int, reserved: int
) -> None:
    got = abandoned_output(cost(reserved), seqs, elapsed - start, rate)
    decoding = max(0, elapsed - start)
    assert 0 <= got <= reserved
    assert got == min(reserved, -(-decoding * rate * seqs // 1000))


def test_json_responses_teach_a_rate_but_no_start() -> None:
    """A model whose traffic is all JSON learns its rate too; its start stays what chunked
    responses taught (0 without any)."""
    rates = DecodeRates()
    for _ in range(dr.MIN_SAMPLES):
        rates.observe("m", 300, 1, 1000, None)
    assert rates.abandon("m", 200) == (300, 0)
    for _ in range(dr.MIN_SAMPLES):
        rates.observe("m", 300, 1, 1000, 80)
    assert rates.abandon("m", 200) == (300, 80)
    assert rates.start_ms("m") == 80 and rates.start_ms("other") == 0


def test_long_prompts_cannot_lengthen_the_start_abandons_are_billed_after() -> None:
    """A tenant's few long-prompt streams (a 3 s prefill) among the model's traffic do not
    move the start an abandon is billed after: the shortest start kept stands."""
    rates = DecodeRates()
    for _ in range(dr.MIN_SAMPLES):
        rates.observe("m", 400, 1, 1000, 100)
    for _ in range(dr.WINDOW - 1):
        rates.observe("m", 400, 1, 1000, 3000)
    assert rates.abandon("m", 200) == (400, 100)


def test_a_non_stream_is_billed_at_the_json_speed_once_the_model_has_enough_json() -> None:
    """An engine decodes a non-stream faster than a stream (measured with the CPU vLLM: a
    stream 10-17 % slower): an abandoned non-stream is billed at the median of the model's
    JSON responses once it has MIN_SAMPLES of them, an abandoned stream at its chunked
    responses'; either at the median of both kinds until its own kind has enough."""
    rates = DecodeRates()
    for _ in range(dr.MIN_SAMPLES):
        rates.observe("m", 350, 1, 1000, 100)  # streams: 350/s, first chunk after 100 ms
    for _ in range(dr.MIN_SAMPLES - 1):
        rates.observe("m", 420, 1, 1000, None)  # non-streams: 420/s
    # 4 JSON responses: not enough of their own; both kinds (9: 5 x 350, 4 x 420)
    assert rates.abandon("m", 200, json=True) == (350, 100)
    assert rates.samples("m", json=True) == dr.WINDOW
    assert rates.abandon("m", 200, json=False) == (350, 100)
    rates.observe("m", 420, 1, 1000, None)
    assert rates.abandon("m", 200, json=True) == (420, 100)
    assert rates.samples("m", json=True) == dr.MIN_SAMPLES
    assert rates.abandon("m", 200, json=False) == (350, 100)  # streams keep theirs
    assert rates.samples("m", json=False) == dr.MIN_SAMPLES


def test_a_model_with_little_of_either_kind_learns_from_both() -> None:
    rates = DecodeRates()
    for _ in range(3):
        rates.observe("m", 300, 1, 1000, 50)
        rates.observe("m", 300, 1, 1000, None)
    # the rate from both kinds; no start yet (3 chunked responses gave one)
    assert rates.abandon("m", 200, json=True) == (300, 0)
    assert rates.abandon("m", 200, json=False) == (300, 0)
