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
from extproc.core.levels import level_header, level_label
from extproc.core.rules import LEVEL_SCOPES, BucketCharge, Charging, Limit, Rates, Usage
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
    # a non-streaming request sent upstream as a stream with usage, metered as one and its
    # JSON reassembled for the client (the exact path: an abandon settles on what passed)
    upstream_stream: bool = False

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
    *,
    input_tokens: int,
    per_choice_max: int,
    n: int,
    stream: bool,
    charging: Charging,
    exact_json: bool = False,
) -> Cost:
    """The admission cost under ``charging.mode`` (see docs/semantics.md for each mode).

    ``n`` is the number of sequences the upstream may generate, ``per_choice_max`` the
    budget of each.  ``exact_json``: a non-streaming request that settles to its actual
    figures is sent upstream as a stream and metered as it passes (never enforced: its whole
    budget is reserved), so that an abandon settles on what the engine generated."""
    eff = per_choice_max * n
    every = charging.charge_every_tokens
    strict = charging.streaming == "strict"
    mode = charging.mode
    meter, enforce, settle = False, False, True
    upstream_stream = False
    if mode == "input_only":
        reserve, settle = 0, False
    elif mode == "reserve_max":
        reserve, settle = eff, False
    elif mode == "reserve_refund":
        reserve, meter = eff, stream or exact_json
        upstream_stream = exact_json and not stream
    elif not stream:  # stream_incremental, a JSON response: reserve, settle to usage
        reserve = eff
        meter = upstream_stream = exact_json
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
        upstream_stream=upstream_stream,
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
    exact_json: bool = False,
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
        exact_json=exact_json,
    )
    return AdmissionPlan(budget=budget, clamped=clamped, cost=cost)


def human_duration(seconds: float) -> str:
    """A reset time for people: ``41s``, ``6m 0s``, ``5h 3m``, ``28d 16h`` (whole seconds rounded
    up the same way as ``retry-after``)."""
    s = retry_seconds(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 2 * 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def retry_seconds(reset_s: float) -> int:
    """Whole seconds a client waits: the one rounding used by messages and headers alike."""
    return max(1, math.ceil(reset_s))


def buckets_for(
    *,
    prefix: str,
    tenant: str,
    key_name: str,
    model: str,
    limits: tuple[Limit, ...],
    now_ms: int,
    prices: Rates | None = None,
    lease_ms: int = 0,
    user: str = "",
) -> list[WindowedBucket]:
    """The buckets (current windows) that apply to a request for ``model`` (``tenant``: its
    slot id, :func:`extproc.core.keys.slot_id`; ``user``: its end user)."""
    return windowed(
        prefix,
        tenant,
        key_name,
        [lim for lim in limits if lim.applies_to(model)],
        now_ms,
        prices=prices,
        lease_ms=lease_ms,
        user=user,
    )


def admission_usage(cost: Cost) -> Usage:
    """What admission charges: the input and the reserved output, one request."""
    return Usage(input=cost.input_tokens, output=cost.reserved_output, requests=cost.requests)


def admission_amount(b: WindowedBucket, cost: Cost) -> int:
    """What admission adds to ``b``: requests, one slot, or the units of input + reservation."""
    if b.kind == "rpm":
        return cost.requests
    if b.kind in ("concurrency", "users"):
        return 1
    return b.rates.units(admission_usage(cost))


def admission_charges(buckets: list[WindowedBucket], cost: Cost) -> list[BucketCharge]:
    """What admission adds to each bucket, and what of it a dead processor's reclaim refunds
    (the reserved output, unless the admission charge is final: ``reserve_max``).

    :func:`admission_amount` of each bucket, with the usage made once for all of them."""
    usage: Usage | None = None
    out: list[BucketCharge] = []
    for b in buckets:
        kind = b.kind
        rates = b.rates
        refundable = 0
        if kind == "rpm":
            amount = cost.requests
        elif kind in ("concurrency", "users"):
            amount = 1
        else:
            if usage is None:
                usage = admission_usage(cost)
            amount = rates.units(usage)
            if kind == "tpm" and cost.settle_to_actual:
                refundable = rates.output_units(cost.reserved_output)
        lim = b.limit
        out.append(
            BucketCharge(
                b.key,
                kind,
                amount,
                lim.limit,
                b.expire_at_ms,
                rates.output,
                refundable,
                lim.shadow,
                b.prev_key,
                b.prev_weight,
            )
        )
    return out


def token_charges(buckets: list[WindowedBucket], amount: int) -> list[BucketCharge]:
    """A stream charge of ``amount`` output tokens: the per-token buckets only."""
    return [
        BucketCharge(
            b.key,
            "tpm",
            b.rates.output_units(amount),
            b.limit.limit,
            b.expire_at_ms,
            rate=b.rates.output,
            shadow=b.limit.shadow,
            prev_key=b.prev_key,
            prev_weight=b.prev_weight,
        )
        for b in buckets
        if b.kind == "tpm"
    ]


#: The header family of each limit kind (OpenAI's names for requests and tokens).
HEADER_FAMILY = {
    "rpm": "requests",
    "tpm": "tokens",
    "cost": "budget",
    "concurrency": "concurrency",
    "users": "users",
}


def rate_limit_headers(
    buckets: list[WindowedBucket],
    values: tuple[int, ...] | list[int],
    now_ms: int,
    *,
    tenant: str = "",
) -> RateLimitHeaders:
    """``x-ratelimit-*`` headers from the binding (least remaining) bucket of each kind,
    whatever level it belongs to.

    OpenAI's six for requests and tokens; ``-budget`` (money in the currency's units, e.g.
    ``12.345678``, or weighted tokens) and ``-concurrency`` (no reset) beside them; where the
    binding bucket is a level's (organisation, team, end user), ``x-ratelimit-level-<kind>``
    names it (``organisation=acme``).  Shadow limits never appear (they bind nothing)."""
    best: dict[str, tuple[float, WindowedBucket, int]] = {}
    for b, v in zip(buckets, values, strict=True):
        if b.limit.shadow or b.metric == "users":
            continue
        family = HEADER_FAMILY[b.metric]
        remaining = b.limit.limit - v
        # least room; budgets may mix units (money, weighted tokens): least share of room
        room: float = remaining
        if family == "budget":
            room = remaining / b.limit.limit if b.limit.limit else 0.0
        cur = best.get(family)
        if cur is None or room < cur[0]:
            best[family] = (room, b, remaining)
    h: dict[str, object] = {}
    if "requests" in best:
        _, b, rem = best["requests"]
        h.update(
            limit_requests=b.limit.limit, remaining_requests=rem, reset_requests_s=b.reset_s(now_ms)
        )
    if "tokens" in best:
        _, b, rem = best["tokens"]
        h.update(limit_tokens=b.limit.limit, remaining_tokens=rem, reset_tokens_s=b.reset_s(now_ms))
    if "budget" in best:
        _, b, rem = best["budget"]
        h.update(
            limit_budget=format_amount(b.limit, b.limit.limit),
            remaining_budget=format_amount(b.limit, max(0, rem)),
            reset_budget_s=b.reset_s(now_ms),
            budget_unit=b.limit.unit,
        )
    if "concurrency" in best:
        _, b, rem = best["concurrency"]
        h.update(limit_concurrency=b.limit.limit, remaining_concurrency=rem)
    levels = tuple(
        (family, level_header(b, tenant))
        for family, (_, b, _) in sorted(best.items())
        if b.limit.scope in LEVEL_SCOPES
    )
    if levels:
        h["levels"] = levels
    return RateLimitHeaders(**h)  # type: ignore[arg-type]


#: Money counters are kept in micro-units of the currency.
MICRO = 1_000_000


def format_amount(limit: Limit, units: int) -> str:
    """A cost counter's value for people: ``12.50 USD``-style decimals, or weighted tokens."""
    if limit.unit == "weighted":
        return str(units)
    whole, frac = divmod(units, MICRO)
    text = f"{whole}.{frac:06d}".rstrip("0")
    if len(text.split(".")[1]) < 2:
        text = f"{whole}.{frac // 10_000:02d}"
    return text


def describe(limit: Limit) -> str:
    """How a message names a limit: ``tokens per minute``, ``budget of 50.00 USD per month``."""
    per = limit.period_name
    if limit.metric == "rpm":
        return f"requests per {per}"
    if limit.metric == "tpm":
        return f"tokens per {per}"
    if limit.metric == "concurrency":
        return "concurrent requests"
    if limit.metric == "users":
        return f"distinct end users per {per}"
    if limit.unit == "weighted":
        return f"weighted tokens per {per}"
    return f"budget of {format_amount(limit, limit.limit)} {limit.unit} per {per}"


def would_refuse(b: WindowedBucket, value: int, amount: int) -> bool:
    """Whether ``amount`` more would take ``b`` past its limit (values as found)."""
    return amount > 0 and value + amount > b.limit.limit


def refusal(
    buckets: list[WindowedBucket],
    values: tuple[int, ...],
    cost: Cost,
    now_ms: int,
    *,
    tenant: str,
    model: str,
) -> QuotaExceeded:
    """The 429 for a refused admission, naming the limit that refused and when it resets."""
    headers = rate_limit_headers(buckets, values, now_ms, tenant=tenant)
    failing: list[tuple[WindowedBucket, int]] = [
        (b, v)
        for b, v in zip(buckets, values, strict=True)
        if not b.limit.shadow and would_refuse(b, v, admission_amount(b, cost))
    ]
    if not failing:  # the counters moved between the script and here; report the tightest
        failing = [(b, v) for b, v in zip(buckets, values, strict=True) if not b.limit.shadow][:1]
    if not failing:
        failing = list(zip(buckets, values, strict=True))[:1]
    # Prefer the refusal a client can act on soonest: requests, concurrency, then tokens.
    order = {"rpm": 0, "concurrency": 1, "users": 2, "tpm": 3, "cost": 4}
    failing.sort(key=lambda bv: (order[bv[0].metric], -bv[0].reset_s(now_ms)))
    b, used = failing[0]
    windows = [bb.reset_s(now_ms) for bb, _ in failing if bb.metric != "concurrency"]
    retry = max(windows, default=1.0)
    scope = scope_label(b.limit)
    per = b.limit.period_name
    on = level_label(b, tenant)
    level = level_header(b, tenant)
    if b.metric == "rpm":
        msg = (
            f"Rate limit reached for requests per {per} on {on} ({scope}): "
            f"limit {b.limit.limit}, used {used}. Try again in {retry_seconds(retry)}s."
        )
        return QuotaExceeded(
            msg, metric="rpm", retry_after_s=retry, headers=headers, level=level, limit=b.limit
        )
    if b.metric == "concurrency":
        msg = (
            f"Concurrency limit reached on {on} ({scope}, {b.limit.scope} scope): "
            f"{used} of {b.limit.limit} requests are already running. Retry when one ends."
        )
        return QuotaExceeded(
            msg,
            metric="concurrency",
            retry_after_s=1.0,
            headers=headers,
            level=level,
            limit=b.limit,
        )
    if b.metric == "users":
        msg = (
            f"Too many end users on team {b.limit.owner}: its limit is {b.limit.limit} "
            f"distinct end users per {per} and this request names a new one. Try again in "
            f"{retry_seconds(b.reset_s(now_ms))}s."
        )
        return QuotaExceeded(
            msg,
            metric="users",
            retry_after_s=b.reset_s(now_ms),
            headers=headers,
            level=level,
            limit=b.limit,
        )
    amount = admission_amount(b, cost)
    too_large = [
        fb
        for fb, _ in failing
        if fb.limit.counts_tokens and admission_amount(fb, cost) > fb.limit.limit
    ]
    if too_large:
        b = min(too_large, key=lambda fb: fb.limit.limit)
        amount = admission_amount(b, cost)
        if b.metric == "tpm":
            need, cap = f"{amount} tokens", f"{b.limit.limit} tokens per {b.limit.period_name}"
        else:
            need, cap = f"{format_amount(b.limit, amount)} {b.limit.unit}", describe(b.limit)
        msg = (
            f"Request too large for {level_label(b, tenant)} ({scope_label(b.limit)}): it "
            f"needs {need} ({cost.input_tokens} input + {cost.reserved_output} reserved output) "
            f"but the limit is {cap}. Shorten the prompt or lower max_tokens."
        )
        return QuotaExceeded(
            msg,
            metric=b.metric,
            retry_after_s=None,
            headers=headers,
            level=level_header(b, tenant),
            limit=b.limit,
        )
    if b.metric == "cost":
        msg = (
            f"Budget exhausted on {on} ({scope}): {describe(b.limit)}, used "
            f"{format_amount(b.limit, used)}, this request needs up to "
            f"{format_amount(b.limit, amount)}. It resets in {human_duration(retry)}."
        )
        return QuotaExceeded(
            msg, metric="cost", retry_after_s=retry, headers=headers, level=level, limit=b.limit
        )
    msg = (
        f"Rate limit reached for tokens per {per} on {on} ({scope}): limit "
        f"{b.limit.limit}, used {used}, requested {cost.tpm_amount}. Try again in {retry_seconds(retry)}s."
    )
    _ = model
    return QuotaExceeded(
        msg, metric="tpm", retry_after_s=retry, headers=headers, level=level, limit=b.limit
    )


def scope_label(limit: Limit) -> str:
    """How messages name a bucket's model scope."""
    return "all models" if limit.model == "*" else f"model {limit.model}"
