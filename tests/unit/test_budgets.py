"""Budgets, weighted tokens, long periods, concurrency and shadow limits: the pure arithmetic
(rates and rounding, calendar windows, admission amounts, refusals, headers, settlement)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.config.load import ConfigError, load_config_text
from extproc.core import admission_plan
from extproc.core.account import RequestAccount
from extproc.core.admission_plan import compute_cost
from extproc.core.keys import window_bounds, windowed
from extproc.core.rules import Charging, Limit, Rates, Usage, ceil_div

pytestmark = pytest.mark.unit

# $3 per million input tokens, $0.30 cached, $15 output: micro-dollars per million tokens
PRICES = Rates(input=3_000_000, cached_input=300_000, output=15_000_000, reasoning=15_000_000)
BUDGET = Limit("cost", 50 * 1_000_000, 0, "*", "tenant", period="month", unit="USD")
TPM = Limit("tpm", 100_000, 60, "*", "tenant")
CONC = Limit("concurrency", 2, 0, "*", "tenant")


def ms(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> int:
    """Unix ms of a UTC date and time."""
    return int(datetime(year, month, day, hour, minute, second, tzinfo=UTC).timestamp() * 1000)


# -- rounding ------------------------------------------------------------------------------


@given(
    parts=st.lists(st.integers(1, 5_000), min_size=1, max_size=40),
    rate=st.integers(1, 200_000_000),
)
def test_charging_in_any_split_differs_by_at_most_one_unit_per_charge(
    parts: list[int], rate: int
) -> None:
    """Charging N output tokens in any split never differs from charging them at once by more
    than one micro-unit per charge, and never charges less."""
    r = Rates(output=rate)
    split = sum(r.output_units(p) for p in parts)
    once = r.output_units(sum(parts))
    assert once <= split <= once + len(parts)


@given(a=st.integers(-(10**12), 10**12), b=st.integers(1, 10**9))
def test_ceil_div_is_exact(a: int, b: int) -> None:
    """Integer ceiling division (no float drift)."""
    q = ceil_div(a, b)
    assert (q - 1) * b < a <= q * b


def test_units_price_each_kind() -> None:
    """Cached input and reasoning are priced at their own rates, within input and output."""
    u = Usage(input=1_000, cached_input=400, output=2_000, reasoning=500, requests=1)
    # 600 x 3 + 400 x 0.3 + 1500 x 15 + 500 x 15 micro-dollars
    assert PRICES.units(u) == 1_800 + 120 + 22_500 + 7_500
    assert Rates().units(u) == 3_000  # a TPM counter counts every token once
    assert Rates(request=1_000).units(Usage(requests=1)) == 1_000


# -- windows -------------------------------------------------------------------------------


def test_month_window_is_the_calendar_month() -> None:
    """A month runs from the 1st 00:00 to the next 1st, in UTC by default."""
    name, start, end = window_bounds(BUDGET, ms(2026, 12, 31, 23, 59, 59))
    assert (name, start, end) == ("m202612", ms(2026, 12, 1), ms(2027, 1, 1))
    name2, start2, _ = window_bounds(BUDGET, ms(2027, 1, 1, 0, 0, 0))
    assert name2 == "m202701" and start2 == ms(2027, 1, 1)
    feb = window_bounds(BUDGET, ms(2028, 2, 29, 12))
    assert feb[1:] == (ms(2028, 2, 1), ms(2028, 3, 1))


def test_month_in_a_time_zone_follows_its_calendar() -> None:
    """Berlin's January starts at 23:00 UTC on December 31st (UTC+1 in winter)."""
    berlin = Limit("cost", 1, 0, "*", "tenant", period="month", tz="Europe/Berlin", unit="USD")
    name, start, end = window_bounds(berlin, ms(2026, 12, 31, 23, 30))
    assert name == "m202701.Europe.Berlin"
    assert start == ms(2026, 12, 31, 23) and end == ms(2027, 1, 31, 23)


def test_week_starts_on_monday() -> None:
    """UTC weeks run Monday 00:00 to Monday 00:00."""
    week = Limit("tpm", 1, 7 * 86400, "*", "tenant", period="week")
    _, start, end = window_bounds(week, ms(2026, 12, 3, 15))  # a Thursday
    assert start == ms(2026, 11, 30) and end == ms(2026, 12, 7)
    berlin = Limit("tpm", 1, 7 * 86400, "*", "tenant", period="week", tz="Europe/Berlin")
    _, bstart, _ = window_bounds(berlin, ms(2026, 12, 3, 15))
    assert bstart == ms(2026, 11, 29, 23)


def test_minute_windows_keep_their_epoch_numbering() -> None:
    """Existing fixed windows keep their keys (counters survive an upgrade)."""
    [b] = windowed("aiq", "acme", "k", [TPM], 90_000)
    assert b.key == "aiq:{acme}:tpm:t:*:60:1" and b.window_end_ms == 120_000


def test_cost_and_shadow_and_concurrency_keys_are_distinct() -> None:
    """A budget, its shadow trial and a weighted limit never share a counter."""
    shadow = Limit("cost", 1, 0, "*", "tenant", period="month", unit="USD", shadow=True)
    weighted = Limit("cost", 1, 0, "*", "tenant", period="month", unit="weighted", weights=Rates())
    keys = [b.key for b in windowed("aiq", "t", "k", [BUDGET, shadow, weighted, CONC], 0)]
    assert len(set(keys)) == 4
    assert keys[0].startswith("aiq:{t}:cost.USD:") and ".shadow:" in keys[1]
    assert keys[3] == "aiq:{t}:conc:t:*"


# -- admission -----------------------------------------------------------------------------


def cost(input_tokens: int, budget: int, *, stream: bool = False, strict: bool = False) -> Any:
    return compute_cost(
        input_tokens=input_tokens,
        per_choice_max=budget,
        n=1,
        stream=stream,
        charging=Charging(streaming="strict" if strict else "lazy", charge_every_tokens=64),
    )


def test_admission_amounts_per_kind() -> None:
    """RPM 1, a concurrency slot 1, TPM the tokens, a budget the price of input + reserved."""
    rpm = Limit("rpm", 10, 60, "*", "tenant")
    bs = windowed("aiq", "t", "k", [rpm, TPM, BUDGET, CONC], 0, prices=PRICES, lease_ms=15_000)
    charges = admission_plan.admission_charges(bs, cost(1_000, 100))
    amounts = {c.kind + (":cost" if "cost" in c.key else ""): c.amount for c in charges}
    assert amounts == {"rpm": 1, "tpm": 1_100, "tpm:cost": 3_000 + 1_500, "concurrency": 1}
    by_key = {c.key: c for c in charges}
    budget = by_key[bs[2].key]
    assert budget.refundable == 1_500 and budget.rate == 15_000_000


def test_budget_refusal_names_the_budget_and_its_reset() -> None:
    """A budget refusal says which budget, how much was used, and when it resets."""
    now = ms(2026, 12, 31, 23, 0)
    bs = windowed("aiq", "acme", "k", [BUDGET], now, prices=PRICES)
    err = admission_plan.refusal(bs, (49_999_000,), cost(100, 100), now, tenant="acme", model="m")
    assert err.code == "budget_exceeded" and err.status == 429
    assert "budget of 50.00 USD per month" in str(err) and "used 49.999" in str(err)
    assert err.retry_after_s == pytest.approx(3600)
    pairs = dict(err.headers.as_pairs())
    assert pairs["x-ratelimit-limit-budget"] == "50.00"
    assert pairs["x-ratelimit-remaining-budget"] == "0.001"
    assert pairs["x-ratelimit-budget-unit"] == "USD"


def test_concurrency_refusal_code() -> None:
    """A full concurrency limit is a 429 with its own code and headers."""
    bs = windowed("aiq", "acme", "k", [CONC], 0, lease_ms=15_000)
    err = admission_plan.refusal(bs, (2,), cost(10, 10), 0, tenant="acme", model="m")
    assert err.code == "concurrency_limit_exceeded"
    assert "2 of 2 requests are already running" in str(err)
    pairs = dict(err.headers.as_pairs())
    assert pairs["x-ratelimit-limit-concurrency"] == "2"
    assert pairs["x-ratelimit-remaining-concurrency"] == "0"


def test_shadow_limits_never_refuse_nor_bind_headers() -> None:
    """A shadow bucket past its limit is not the refusing one, and sets no header."""
    shadow = Limit("tpm", 10, 60, "*", "tenant", shadow=True)
    bs = windowed("aiq", "acme", "k", [shadow, TPM], 0)
    err = admission_plan.refusal(bs, (500, 99_990), cost(100, 100), 0, tenant="acme", model="m")
    assert "limit 100000" in str(err)
    h = admission_plan.rate_limit_headers(bs, (500, 10), 0)
    assert h.limit_tokens == 100_000


# -- settlement ----------------------------------------------------------------------------


def test_settlement_refunds_cached_input_and_unused_reservation_per_limit() -> None:
    """Each counter is settled in its own units: the budget gets the cached-input discount."""
    bs = windowed("aiq", "t", "k", [TPM, BUDGET], 0, prices=PRICES)
    acc = RequestAccount()
    c = cost(1_000, 500)
    acc.record(bs, admission_plan.admission_usage(c))  # 1,500 tokens; 3,000 + 7,500 micro-dollars
    final = Usage(input=1_000, cached_input=800, output=200, requests=1)
    adj = {a.key: a.amount for a in acc.adjustments(final, bs)}
    assert adj[bs[0].key] == 1_200 - 1_500
    assert adj[bs[1].key] == (200 * 3 + 800 * 0.3 + 200 * 15) - 10_500


@given(
    grants=st.lists(st.integers(0, 300), max_size=12),
    cached=st.integers(0, 1_000),
    output=st.integers(0, 4_000),
)
def test_budget_counter_ends_at_the_final_price(
    grants: list[int], cached: int, output: int
) -> None:
    """Whatever was charged along the way, settlement leaves the budget at the final price."""
    bs = windowed("aiq", "t", "k", [BUDGET], 0, prices=PRICES)
    acc = RequestAccount()
    acc.record(bs, Usage(input=1_000, requests=1))
    for g in grants:
        acc.record_output(bs, g)
    final = Usage(input=1_000, cached_input=cached, output=output, requests=1)
    counter = acc.charged(BUDGET) + sum(a.amount for a in acc.adjustments(final, bs))
    assert counter == PRICES.units(final)


# -- configuration -------------------------------------------------------------------------

BASE = """
models:
  m:
    tokenizer: {kind: estimate}
    max_output_tokens: 100
    %s
plans:
  p:
    limits:
%s
tenants:
  t:
    plan: p
    keys: [{name: k, plaintext: sk-t}]
"""

PRICED = "pricing: {currency: USD, input: 3, cached_input: 0.3, output: 15}"


def compile_limits(limits: str, pricing: str = PRICED) -> tuple[Limit, ...]:
    cfg = load_config_text(BASE % (pricing, limits))
    return cfg.tenants["t"].limits


def config_error(limits: str, pricing: str = PRICED) -> str:
    with pytest.raises(ConfigError) as info:
        compile_limits(limits, pricing)
    return str(info.value)


def test_config_compiles_every_new_kind() -> None:
    """Budgets in micro-units, weighted tokens with their weights, concurrency, shadow."""
    lims = compile_limits(
        "      - {per: month, budget: 50.25}\n"
        "      - {per: week, weighted_tokens: 1000, weights: {input: 1, cached_input: 0.1, output: 4}}\n"
        "      - {concurrency: 2, scope: key}\n"
        "      - {per: day, tpm: 100, shadow: true, time_zone: Europe/Berlin}\n"
    )
    budget, weighted, conc, shadow = lims
    assert (budget.metric, budget.limit, budget.unit, budget.period) == (
        "cost",
        50_250_000,
        "USD",
        "month",
    )
    assert weighted.weights == Rates(1_000_000, 100_000, 4_000_000, 4_000_000)
    assert weighted.period == "week" and weighted.window_s == 7 * 86400
    assert (conc.metric, conc.limit, conc.scope, conc.window_s) == ("concurrency", 2, "key", 0)
    assert shadow.shadow and shadow.tz == "Europe/Berlin" and shadow.period == "day"


def test_plan_shadow_marks_every_limit() -> None:
    """``shadow: true`` on a plan makes each of its limits a shadow limit."""
    cfg = load_config_text(
        (BASE % (PRICED, "      - {tpm: 5}\n")).replace("  p:\n", "  p:\n    shadow: true\n")
    )
    assert all(lim.shadow for lim in cfg.tenants["t"].limits)


@pytest.mark.parametrize(
    ("limits", "pricing", "expected"),
    [
        ("      - {per: month, budget: 5}\n", "", "which has no pricing (add models.m.pricing)"),
        ("      - {per: month, budget: 5, currency: EUR}\n", PRICED, "priced in USD"),
        ("      - {per: month, budget: 5, currency: XYZ}\n", PRICED, "unknown currency 'XYZ'"),
        ("      - {per: month, weighted_tokens: 5}\n", PRICED, "go together"),
        ("      - {per: month, tpm: 5, time_zone: Mars/Base}\n", PRICED, "unknown time zone"),
        (
            "      - {per: day, tpm: 1000}\n      - {per: month, tpm: 500}\n",
            PRICED,
            "per month (500) is below the one per day (1000)",
        ),
    ],
)
def test_config_errors_name_the_problem(limits: str, pricing: str, expected: str) -> None:
    """check-config names what is wrong with a budget, a period or a zone, and where."""
    msg = config_error(limits, pricing)
    assert expected in msg
    assert "plans.p.limits" in msg


# -- sliding windows -----------------------------------------------------------------------

SLIDING = Limit("rpm", 100, 60, "*", "tenant", sliding=True)


def test_sliding_bucket_weighs_the_previous_window_by_what_is_still_inside() -> None:
    """15 s into a minute, three quarters of the previous minute still count."""
    [b] = windowed("aiq", "t", "k", [SLIDING], 60_000 * 10 + 15_000)
    assert b.key.endswith(":rpm.sliding:t:*:60:10")
    assert b.prev_key.endswith(":rpm.sliding:t:*:60:9")
    assert b.prev_weight == 750_000
    assert b.expire_at_ms == 60_000 * 12 + 2_000  # kept a window longer: it is read as previous
    [fixed] = windowed("aiq", "t", "k", [TPM], 60_000 * 10 + 15_000)
    assert fixed.prev_key == "" and fixed.prev_weight == 0


def test_sliding_needs_a_fixed_length_window() -> None:
    """Months and time zones have no fixed length: a sliding window there is refused."""
    msg = config_error("      - {per: month, tpm: 5, window: sliding}\n")
    assert "a sliding window needs a fixed length" in msg
    [lim] = compile_limits("      - {per: minute, tpm: 5, window: sliding}\n")
    assert lim.sliding


def test_fallback_names_configured_models() -> None:
    """A plan's fallback maps canonical model names; unknown or self fallbacks are errors."""
    text = BASE % (PRICED, "      - {tpm: 5}\n")
    text = text.replace(
        "plans:\n", "  n:\n    tokenizer: {kind: estimate}\n    max_output_tokens: 9\nplans:\n"
    )
    ok = load_config_text(text.replace("  p:\n", "  p:\n    fallback: {m: n}\n"))
    assert ok.fallbacks == {"p": {"m": "n"}}
    for bad, expected in (("{m: zz}", "unknown fallback model 'zz'"), ("{m: m}", "to itself")):
        with pytest.raises(ConfigError) as info:
            load_config_text(text.replace("  p:\n", f"  p:\n    fallback: {bad}\n"))
        assert expected in str(info.value) and "plans.p.fallback.m" in str(info.value)


def test_budget_messages_give_long_resets_in_days() -> None:
    """A month's reset reads as days and hours, not millions of seconds."""
    assert admission_plan.human_duration(41) == "41s"
    assert admission_plan.human_duration(361) == "6m 1s"
    assert admission_plan.human_duration(3 * 3600 + 120) == "3h 2m"
    assert admission_plan.human_duration(28 * 86400 + 16 * 3600 + 5) == "28d 16h"
    now = ms(2026, 12, 3, 7, 39)
    bs = windowed("aiq", "acme", "k", [BUDGET], now, prices=PRICES)
    err = admission_plan.refusal(bs, (50_000_000,), cost(100, 100), now, tenant="acme", model="m")
    assert "It resets in 28d 16h." in str(err)
