"""Admission arithmetic: what a request costs, which buckets it touches, what the answer says.

Pure: the caller supplies the counted input tokens and the clock reading, runs the limiter,
and hands its result back to :func:`decide`.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.config.runtime import Charging, Limit
from extproc.core.keys import WindowedBucket, windowed
from extproc.errors import QuotaExceeded, RateLimitHeaders
from extproc.limiter.base import BucketCharge


@dataclass(frozen=True, slots=True)
class Cost:
    """TPM cost at admission and how the rest of the request is metered."""

    input_tokens: int
    effective_max_output: int  # all choices together
    reserved_output: int  # output tokens charged at admission
    meter_stream: bool  # count the SSE body
    enforce_stream: bool  # charge every N and cut off when exhausted
    strict: bool
    settle_to_actual: bool  # refund/charge the difference at the end
    every: int

    @property
    def tpm_amount(self) -> int:
        """Tokens charged to every TPM bucket at admission."""
        return self.input_tokens + self.reserved_output


def compute_cost(
    *, input_tokens: int, per_choice_max: int, n: int, stream: bool, charging: Charging
) -> Cost:
    """The admission cost under ``charging.mode`` (see docs/semantics.md for each mode)."""
    eff = per_choice_max * n
    every = charging.charge_every_tokens
    strict = charging.streaming == "strict"
    mode = charging.mode
    if mode == "input_only":
        return Cost(input_tokens, eff, 0, False, False, strict, False, every)
    if mode == "reserve_max":
        return Cost(input_tokens, eff, eff, False, False, strict, False, every)
    if mode == "reserve_refund":
        return Cost(input_tokens, eff, eff, stream, False, strict, True, every)
    # stream_incremental
    if not stream:
        return Cost(input_tokens, eff, eff, False, False, strict, True, every)
    reserve = min(every, eff) if strict else 0
    return Cost(input_tokens, eff, reserve, True, True, strict, True, every)


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
            amount=1 if b.metric == "rpm" else cost.tpm_amount,
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
            f"limit {b.limit.limit}, used {used}. Try again in {retry:.0f}s."
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
        f"{b.limit.limit}, used {used}, requested {cost.tpm_amount}. Try again in {retry:.0f}s."
    )
    _ = model
    return QuotaExceeded(msg, metric="tpm", retry_after_s=retry, headers=headers)


def per_name(window_s: int) -> str:
    """``minute`` for 60 and so on (``90s`` for windows without a name)."""
    return {1: "second", 60: "minute", 3600: "hour", 86400: "day"}.get(window_s, f"{window_s}s")


def scope_label(limit: Limit) -> str:
    """How messages name a bucket's model scope."""
    return "all models" if limit.model == "*" else f"model {limit.model}"
