"""Admission arithmetic: what a request costs, which buckets it touches, what the answer says.

Pure: the caller supplies the parsed request, the resolved model and the counted input
tokens; :func:`plan_admission` returns an :class:`AdmissionPlan` (budget, clamp, cost).  The
caller runs the limiter with :func:`admission_charges` and turns a refusal into a 429 with
:func:`refusal`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from extproc.core.keys import WindowedBucket, windowed
from extproc.core.rules import BucketCharge, Charging, Limit
from extproc.errors import BadRequest, QuotaExceeded, RateLimitHeaders, RequestTooLarge


@dataclass(frozen=True, slots=True, kw_only=True)
class Cost:
    """TPM cost at admission and how the rest of the request is metered."""

    input_tokens: int
    effective_max_output: int  # all sequences together
    reserved_output: int  # output tokens charged at admission
    meter_stream: bool  # count the SSE body
    enforce_stream: bool  # charge every N and cut off when exhausted
    strict: bool
    settle_to_actual: bool  # refund/charge the difference at the end
    every: int
    requests: int = 1  # RPM units

    @property
    def tpm_amount(self) -> int:
        """Tokens charged to every TPM bucket at admission."""
        return self.input_tokens + self.reserved_output


RPM_ONLY = Cost(
    input_tokens=0,
    effective_max_output=0,
    reserved_output=0,
    meter_stream=False,
    enforce_stream=False,
    strict=False,
    settle_to_actual=False,
    every=1,
)


def compute_cost(
    *, input_tokens: int, per_choice_max: int, n: int, stream: bool, charging: Charging
) -> Cost:
    """The admission cost under ``charging.mode`` (see docs/semantics.md for each mode).

    ``n`` is the number of sequences the upstream may generate, ``per_choice_max`` the
    budget of each."""
    eff = per_choice_max * n
    every = charging.charge_every_tokens
    strict = charging.streaming == "strict"
    mode = charging.mode
    meter, enforce, settle = False, False, True
    if mode == "input_only":
        reserve, settle = 0, False
    elif mode == "reserve_max":
        reserve, settle = eff, False
    elif mode == "reserve_refund":
        reserve, meter = eff, stream
    elif not stream:  # stream_incremental, a JSON response: reserve, settle to usage
        reserve = eff
    else:
        reserve = min(every, eff) if strict else 0
        meter = enforce = True
    return Cost(
        input_tokens=input_tokens,
        effective_max_output=eff,
        reserved_output=reserve,
        meter_stream=meter,
        enforce_stream=enforce,
        strict=strict,
        settle_to_actual=settle,
        every=every,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionPlan:
    """What admission decided before asking the limiter."""

    budget: int  # output tokens one sequence may generate (written into the forwarded body)
    clamped: bool  # the client's budget was above the model's cap and was lowered
    cost: Cost


def plan_admission(
    *,
    declared_max_output: int | None,
    sequences: int,
    stream: bool,
    input_tokens: int,
    model_name: str,
    model_cap: int,
    max_input_tokens: int | None,
    over_cap: Literal["clamp", "reject"],
    budget_param: str,
    charging: Charging,
) -> AdmissionPlan:
    """The output budget, whether it was clamped, and the cost (raises 400/413 on limits)."""
    if max_input_tokens is not None and input_tokens > max_input_tokens:
        raise RequestTooLarge(
            f"The prompt has {input_tokens} tokens; model {model_name} accepts at most "
            f"{max_input_tokens}."
        )
    clamped = False
    if declared_max_output is not None and declared_max_output > model_cap:
        if over_cap == "reject":
            raise BadRequest(
                f"{budget_param} is {declared_max_output}; model {model_name} generates at most "
                f"{model_cap} tokens.",
                param=budget_param,
            )
        clamped = True
    budget = model_cap if declared_max_output is None else min(declared_max_output, model_cap)
    cost = compute_cost(
        input_tokens=input_tokens,
        per_choice_max=budget,
        n=sequences,
        stream=stream,
        charging=charging,
    )
    return AdmissionPlan(budget=budget, clamped=clamped, cost=cost)


def retry_seconds(reset_s: float) -> int:
    """Whole seconds a client waits: the one rounding used by messages and headers alike."""
    return max(1, math.ceil(reset_s))


def buckets_for(
    *, prefix: str, tenant: str, key_name: str, model: str, limits: tuple[Limit, ...], now_ms: int
) -> list[WindowedBucket]:
    """The buckets (current windows) that apply to a request for ``model``."""
    return windowed(
        prefix, tenant, key_name, [lim for lim in limits if lim.applies_to(model)], now_ms
    )


def admission_charges(buckets: list[WindowedBucket], cost: Cost) -> list[BucketCharge]:
    """What admission adds to each bucket: 1 to RPM, the TPM amount to TPM."""
    return [
        BucketCharge(
            key=b.key,
            kind=b.metric,
            amount=cost.requests if b.metric == "rpm" else cost.tpm_amount,
            limit=b.limit.limit,
            expire_at_ms=b.expire_at_ms,
        )
        for b in buckets
    ]


def tpm_charges(buckets: list[WindowedBucket], amount: int) -> list[BucketCharge]:
    """A stream charge: the TPM buckets only."""
    return [
        BucketCharge(b.key, "tpm", amount, b.limit.limit, b.expire_at_ms)
        for b in buckets
        if b.metric == "tpm"
    ]


def rate_limit_headers(
    buckets: list[WindowedBucket], values: tuple[int, ...] | list[int], now_ms: int
) -> RateLimitHeaders:
    """OpenAI's headers from the binding (least remaining) RPM and TPM buckets."""
    best: dict[str, tuple[int, WindowedBucket]] = {}
    for b, v in zip(buckets, values, strict=True):
        remaining = b.limit.limit - v
        cur = best.get(b.metric)
        if cur is None or remaining < cur[0]:
            best[b.metric] = (remaining, b)
    h: dict[str, object] = {}
    if "rpm" in best:
        rem, b = best["rpm"]
        h.update(
            limit_requests=b.limit.limit, remaining_requests=rem, reset_requests_s=b.reset_s(now_ms)
        )
    if "tpm" in best:
        rem, b = best["tpm"]
        h.update(limit_tokens=b.limit.limit, remaining_tokens=rem, reset_tokens_s=b.reset_s(now_ms))
    return RateLimitHeaders(**h)  # type: ignore[arg-type]


def refusal(
    buckets: list[WindowedBucket],
    values: tuple[int, ...],
    cost: Cost,
    now_ms: int,
    *,
    tenant: str,
    model: str,
) -> QuotaExceeded:
    """The 429 for a refused admission, naming the bucket that refused and when it resets."""
    headers = rate_limit_headers(buckets, values, now_ms)
    failing: list[tuple[WindowedBucket, int]] = []
    for b, v in zip(buckets, values, strict=True):
        amount = 1 if b.metric == "rpm" else cost.tpm_amount
        if amount > 0 and v + amount > b.limit.limit:
            failing.append((b, v))
    if not failing:  # the counters moved between the script and here; report the tightest
        failing = [(b, v) for b, v in zip(buckets, values, strict=True)][:1]
    # Prefer the RPM refusal when both refuse: it is the one a client can act on soonest.
    failing.sort(key=lambda bv: (bv[0].metric != "rpm", -bv[0].reset_s(now_ms)))
    b, used = failing[0]
    retry = max(bb.reset_s(now_ms) for bb, _ in failing)
    scope = scope_label(b.limit)
    per = per_name(b.limit.window_s)
    if b.metric == "rpm":
        msg = (
            f"Rate limit reached for requests per {per} on tenant {tenant} ({scope}): "
            f"limit {b.limit.limit}, used {used}. Try again in {retry_seconds(retry)}s."
        )
        return QuotaExceeded(msg, metric="rpm", retry_after_s=retry, headers=headers)
    too_large = [fb for fb, _ in failing if fb.metric == "tpm" and cost.tpm_amount > fb.limit.limit]
    if b.metric == "tpm" and too_large:
        b = min(too_large, key=lambda fb: fb.limit.limit)
        scope = scope_label(b.limit)
        per = per_name(b.limit.window_s)
        msg = (
            f"Request too large for tenant {tenant} ({scope}): it needs {cost.tpm_amount} tokens "
            f"({cost.input_tokens} input + {cost.reserved_output} reserved output) but the limit is "
            f"{b.limit.limit} tokens per {per}. Shorten the prompt or lower max_tokens."
        )
        return QuotaExceeded(msg, metric="tpm", retry_after_s=None, headers=headers)
    msg = (
        f"Rate limit reached for tokens per {per} on tenant {tenant} ({scope}): limit "
        f"{b.limit.limit}, used {used}, requested {cost.tpm_amount}. Try again in {retry_seconds(retry)}s."
    )
    _ = model
    return QuotaExceeded(msg, metric="tpm", retry_after_s=retry, headers=headers)


def per_name(window_s: int) -> str:
    """``minute`` for 60 and so on (``90s`` for windows without a name)."""
    return {1: "second", 60: "minute", 3600: "hour", 86400: "day"}.get(window_s, f"{window_s}s")


def scope_label(limit: Limit) -> str:
    """How messages name a bucket's model scope."""
    return "all models" if limit.model == "*" else f"model {limit.model}"
