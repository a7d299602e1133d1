"""Unit tests for admission arithmetic: costs, rate-limit headers and 429s (extproc.core.admission_plan)."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.core import admission_plan
from extproc.core.admission_plan import Cost, compute_cost, rate_limit_headers, refusal
from extproc.core.keys import WindowedBucket
from extproc.core.rules import Charging, Limit
from extproc.errors import QuotaExceeded

pytestmark = pytest.mark.unit

# An hour boundary (472_222 whole hours since the epoch) plus 15.25 s.
NOW_MS = 472_222 * 3_600_000 + 15_250
MIN_END = (NOW_MS // 60_000 + 1) * 60_000
HOUR_END = (NOW_MS // 3_600_000 + 1) * 3_600_000


def charging(mode: Any, streaming: Any = "lazy", every: int = 64) -> Charging:
    """A Charging with the given fields."""
    return Charging(mode=mode, streaming=streaming, charge_every_tokens=every)


def cost_of(mode: str, *, stream: bool, strict: bool, per_choice: int = 100, n: int = 2) -> Cost:
    """compute_cost with 50 input tokens, ``per_choice`` x ``n`` output and every=64."""
    return compute_cost(
        input_tokens=50,
        per_choice_max=per_choice,
        n=n,
        stream=stream,
        charging=charging(mode, "strict" if strict else "lazy"),
    )


def buckets(*limits: Limit, now_ms: int = NOW_MS) -> list[WindowedBucket]:
    """Windowed buckets for tenant 'acme' / key 'k1' / model 'm'."""
    return admission_plan.buckets_for(
        prefix="aq", tenant="acme", key_name="k1", model="m", limits=limits, now_ms=now_ms
    )


RPM_MIN = Limit("rpm", 10, 60, "*", "tenant")
TPM_MIN = Limit("tpm", 1000, 60, "*", "tenant")
TPM_HOUR = Limit("tpm", 20_000, 3600, "*", "tenant")
RPM_HOUR = Limit("rpm", 100, 3600, "*", "tenant")


# -- compute_cost --------------------------------------------------------------------------

# (mode, stream, strict) -> (reserved_output, meter_stream, enforce_stream, settle_to_actual)
COST_TABLE: list[tuple[str, bool, bool, int, bool, bool, bool]] = [
    ("input_only", False, False, 0, False, False, False),
    ("input_only", True, False, 0, False, False, False),
    ("input_only", False, True, 0, False, False, False),
    ("input_only", True, True, 0, False, False, False),
    ("reserve_max", False, False, 200, False, False, False),
    ("reserve_max", True, False, 200, False, False, False),
    ("reserve_max", False, True, 200, False, False, False),
    ("reserve_max", True, True, 200, False, False, False),
    ("reserve_refund", False, False, 200, False, False, True),
    ("reserve_refund", True, False, 200, True, False, True),
    ("reserve_refund", False, True, 200, False, False, True),
    ("reserve_refund", True, True, 200, True, False, True),
    ("stream_incremental", False, False, 200, False, False, True),
    ("stream_incremental", False, True, 200, False, False, True),
    ("stream_incremental", True, False, 0, True, True, True),
    ("stream_incremental", True, True, 64, True, True, True),
]


@pytest.mark.parametrize(
    ("mode", "stream", "strict", "reserved", "meter", "enforce", "settle"), COST_TABLE
)
def test_compute_cost_table(
    mode: str,
    stream: bool,
    strict: bool,
    reserved: int,
    meter: bool,
    enforce: bool,
    settle: bool,
) -> None:
    """Each charging mode, stream flag and lazy/strict mode reserves, meters and settles as documented."""
    c = cost_of(mode, stream=stream, strict=strict)
    assert c.input_tokens == 50
    assert c.effective_max_output == 200
    assert c.reserved_output == reserved
    assert c.tpm_amount == 50 + reserved
    assert (c.meter_stream, c.enforce_stream, c.settle_to_actual) == (meter, enforce, settle)
    assert c.strict is strict
    assert c.every == 64


def test_strict_stream_reserve_capped_by_effective_max() -> None:
    """Strict streaming leases min(every, effective max): a tiny budget reserves only itself."""
    c = cost_of("stream_incremental", stream=True, strict=True, per_choice=5, n=2)
    assert c.reserved_output == 10
    assert c.tpm_amount == 60


def test_cost_every_follows_charging() -> None:
    """``every`` is the plan's charge_every_tokens."""
    c = compute_cost(
        input_tokens=1,
        per_choice_max=1000,
        n=1,
        stream=True,
        charging=charging("stream_incremental", "strict", every=256),
    )
    assert c.every == 256
    assert c.reserved_output == 256


# -- buckets_for ---------------------------------------------------------------------------


def test_buckets_for_filters_by_model() -> None:
    """Only limits for '*' or the request's model apply."""
    other = Limit("rpm", 5, 60, "other", "tenant")
    mine = Limit("tpm", 5, 60, "m", "tenant")
    got = buckets(RPM_MIN, other, mine)
    assert [b.limit for b in got] == [RPM_MIN, mine]


def test_admission_charges_amounts() -> None:
    """Admission adds 1 to each RPM bucket and the TPM amount to each TPM bucket."""
    bs = buckets(RPM_MIN, TPM_MIN, TPM_HOUR)
    c = cost_of("reserve_max", stream=False, strict=False)
    charges = admission_plan.admission_charges(bs, c)
    assert [(ch.kind, ch.amount, ch.limit) for ch in charges] == [
        ("rpm", 1, 10),
        ("tpm", 250, 1000),
        ("tpm", 250, 20_000),
    ]
    assert [ch.key for ch in charges] == [b.key for b in bs]
    assert charges[0].expire_at_ms == MIN_END + 2_000


def test_tpm_charges_skip_rpm() -> None:
    """A stream charge touches only TPM buckets."""
    bs = buckets(RPM_MIN, TPM_MIN, TPM_HOUR)
    charges = admission_plan.token_charges(bs, 64)
    assert [(ch.kind, ch.amount, ch.key) for ch in charges] == [
        ("tpm", 64, bs[1].key),
        ("tpm", 64, bs[2].key),
    ]


# -- rate_limit_headers --------------------------------------------------------------------


def test_headers_pick_least_remaining_per_metric() -> None:
    """Per metric the bucket with the least remaining is reported, with its window's reset."""
    bs = buckets(RPM_MIN, RPM_HOUR, TPM_MIN, TPM_HOUR)
    # rpm: minute has 10-3=7 left, hour 100-95=5 left → hour binds.
    # tpm: minute has 1000-100=900 left, hour 20000-19950=50 left → hour binds.
    h = rate_limit_headers(bs, (3, 95, 100, 19_950), NOW_MS)
    assert (h.limit_requests, h.remaining_requests) == (100, 5)
    assert h.reset_requests_s == pytest.approx(3584.75)
    assert (h.limit_tokens, h.remaining_tokens) == (20_000, 50)
    assert h.reset_tokens_s == pytest.approx(3584.75)


def test_headers_minute_binds() -> None:
    """When the minute bucket has less left, its limit and reset are reported."""
    bs = buckets(RPM_MIN, RPM_HOUR, TPM_MIN, TPM_HOUR)
    h = rate_limit_headers(bs, (9, 10, 990, 10), NOW_MS)
    assert (h.limit_requests, h.remaining_requests) == (10, 1)
    assert h.reset_requests_s == pytest.approx(44.75)
    assert (h.limit_tokens, h.remaining_tokens) == (1000, 10)
    assert h.reset_tokens_s == pytest.approx(44.75)


def test_headers_only_tpm() -> None:
    """Without RPM buckets the request headers are absent."""
    h = rate_limit_headers(buckets(TPM_MIN), [10], NOW_MS)
    assert h.limit_requests is None
    assert h.remaining_requests is None
    assert h.limit_tokens == 1000
    assert [name for name, _ in h.as_pairs()] == [
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    ]


def test_headers_negative_remaining_rendered_as_zero() -> None:
    """A bucket over its limit reports remaining 0 in the header, not a negative number."""
    h = rate_limit_headers(buckets(TPM_MIN), [1200], NOW_MS)
    assert h.remaining_tokens == -200
    assert ("x-ratelimit-remaining-tokens", "0") in h.as_pairs()


def test_headers_length_mismatch_raises() -> None:
    """Values must match buckets one to one."""
    with pytest.raises(ValueError):
        rate_limit_headers(buckets(RPM_MIN, TPM_MIN), [1], NOW_MS)


# -- refusal -------------------------------------------------------------------------------


def test_refusal_rpm() -> None:
    """A full RPM bucket gives rpm_limit_exceeded / requests, retry at the window's end."""
    bs = buckets(RPM_MIN, TPM_MIN)
    c = cost_of("reserve_max", stream=False, strict=False)
    err = refusal(bs, (10, 0), c, NOW_MS, tenant="acme", model="m")
    assert isinstance(err, QuotaExceeded)
    assert err.status == 429
    assert (err.code, err.error_type, err.metric) == ("rpm_limit_exceeded", "requests", "rpm")
    assert err.retry_after_s == pytest.approx(44.75)
    assert "requests per minute" in err.message
    assert "acme" in err.message
    assert "limit 10, used 10" in err.message
    assert err.headers.remaining_requests == 0


def test_refusal_tpm() -> None:
    """A TPM bucket that cannot take the cost gives tpm_limit_exceeded / tokens."""
    bs = buckets(RPM_MIN, TPM_MIN)
    c = cost_of("reserve_max", stream=False, strict=False)  # 250 tokens
    err = refusal(bs, (1, 800), c, NOW_MS, tenant="acme", model="m")
    assert (err.code, err.error_type, err.metric) == ("tpm_limit_exceeded", "tokens", "tpm")
    assert err.retry_after_s == pytest.approx(44.75)
    assert "tokens per minute" in err.message
    assert "used 800, requested 250" in err.message


def test_refusal_tpm_exact_fit_not_failing_picks_other() -> None:
    """A bucket that fits exactly (used + cost == limit) is not the one blamed."""
    bs = buckets(TPM_MIN, TPM_HOUR)
    c = cost_of("reserve_max", stream=False, strict=False)  # 250 tokens
    err = refusal(bs, (750, 19_900), c, NOW_MS, tenant="acme", model="m")
    assert err.retry_after_s == pytest.approx(3584.75)
    assert "tokens per hour" in err.message


def test_refusal_request_too_large() -> None:
    """A cost above the TPM limit itself says 'Request too large' and gives no retry time."""
    bs = buckets(RPM_MIN, TPM_MIN)
    c = compute_cost(
        input_tokens=900, per_choice_max=200, n=1, stream=False, charging=charging("reserve_max")
    )
    err = refusal(bs, (0, 0), c, NOW_MS, tenant="acme", model="m")
    assert err.code == "tpm_limit_exceeded"
    assert err.retry_after_s is None
    assert err.message.startswith("Request too large")
    assert "1100 tokens" in err.message
    assert "900 input + 200 reserved output" in err.message


def test_refusal_prefers_rpm_when_both_refuse() -> None:
    """When RPM and TPM both refuse, the RPM refusal is returned."""
    bs = buckets(TPM_MIN, RPM_MIN)
    c = cost_of("reserve_max", stream=False, strict=False)
    err = refusal(bs, (990, 10), c, NOW_MS, tenant="acme", model="m")
    assert err.code == "rpm_limit_exceeded"
    assert err.error_type == "requests"


def test_refusal_retry_is_latest_failing_window() -> None:
    """With minute and hour RPM both full, retry waits for the hour window."""
    bs = buckets(RPM_MIN, RPM_HOUR)
    c = cost_of("input_only", stream=False, strict=False)
    err = refusal(bs, (10, 100), c, NOW_MS, tenant="acme", model="m")
    assert err.retry_after_s == pytest.approx(3584.75)
    assert "requests per hour" in err.message


def test_refusal_model_scope_in_message() -> None:
    """A model-specific limit names the model in the message; '*' says all models."""
    lim = Limit("rpm", 1, 60, "m", "tenant")
    c = cost_of("input_only", stream=False, strict=False)
    err = refusal(buckets(lim), (1,), c, NOW_MS, tenant="acme", model="m")
    assert "(model m)" in err.message
    err2 = refusal(buckets(RPM_MIN), (10,), c, NOW_MS, tenant="acme", model="m")
    assert "(all models)" in err2.message


def test_refusal_when_no_bucket_fails_reports_first() -> None:
    """If counters moved and nothing fails now, the first bucket is reported."""
    bs = buckets(RPM_MIN, TPM_MIN)
    c = cost_of("input_only", stream=False, strict=False)
    err = refusal(bs, (0, 0), c, NOW_MS, tenant="acme", model="m")
    assert err.code == "rpm_limit_exceeded"


def test_refusal_zero_tpm_amount_never_blames_tpm() -> None:
    """A zero TPM cost cannot make a full TPM bucket refuse."""
    bs = buckets(TPM_MIN, RPM_MIN)
    c = compute_cost(
        input_tokens=0, per_choice_max=100, n=1, stream=False, charging=charging("input_only")
    )
    err = refusal(bs, (1000, 10), c, NOW_MS, tenant="acme", model="m")
    assert err.code == "rpm_limit_exceeded"


def test_refusal_too_large_for_minute_hidden_by_hour_bucket() -> None:
    """A cost above the minute TPM limit is 'too large' even when the hour bucket also refuses."""
    bs = buckets(TPM_MIN, TPM_HOUR)
    c = compute_cost(
        input_tokens=1500, per_choice_max=100, n=1, stream=False, charging=charging("reserve_max")
    )
    err = refusal(bs, (0, 19_000), c, NOW_MS, tenant="acme", model="m")
    assert err.retry_after_s is None
    assert err.message.startswith("Request too large")


@pytest.mark.parametrize(
    ("window_s", "name"),
    [(1, "second"), (60, "minute"), (3600, "hour"), (86400, "day"), (604800, "week"), (7, "7s")],
)
def test_period_name(window_s: int, name: str) -> None:
    """Window lengths are named as in the config file (others as seconds)."""
    assert Limit("tpm", 1, window_s, "*", "tenant").period_name == name
    assert Limit("tpm", 1, 0, "*", "tenant", period="month").period_name == "month"
