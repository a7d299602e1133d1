"""Per-request rules that used to sit beside the I/O, one function each (sans-IO).

Whoever changes how a request is admitted or billed finds the rule here with its tests
(``tests/unit/test_core_policies.py``): when admission may decide on a bound of the input, how
long an admission is leased, whether a refusal counts, what a limiter failure or a full
settlement backlog does, the fallback model, the shadow report, and the billing record of a
request reclaimed from a dead processor (a settled request's is planned with its settlement,
:mod:`extproc.core.settlement`).  The admission flow that applies them is :mod:`extproc.core.admission_flow`; the
stream's own rules (room after a charge, the unconfirmed charge, the wait for a charge at
settlement) are in :mod:`extproc.core.streaming`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from decimal import Decimal

from extproc.core import admission_plan
from extproc.core.admission_plan import Cost
from extproc.core.keys import WindowedBucket
from extproc.core.phase_records import ModelInfo, TenantInfo
from extproc.core.rules import Rates, Usage


def fails_open(failure_mode: str) -> bool:
    """A limiter failure lets the request through unmetered (``open``), rather than refusing
    it or cutting its stream (``closed``)."""
    return failure_mode == "open"


def unmetered_on_backlog(failure_mode: str) -> bool:
    """The settlements waiting for Redis reached their backlog: admitting more would pile up
    more (dropping one would lose a correction), so admission pushes back: a plan that fails
    open lets the request through unmetered, any other refuses it (503)."""
    return fails_open(failure_mode)


def keeps_cancel(*, maybe_ran: bool) -> bool:
    """Whether a failed admission call keeps a cancel: when it may have run, or may still run
    once Redis answers (it timed out rather than failed); the cancel undoes it if it ran, or
    stops it from ever running.  (A call cancelled because the request went away always keeps
    one.)"""
    return maybe_ran


def may_admit_on_bound(*, enabled: bool, proven_bound: bool) -> bool:
    """Whether admission may decide on an upper bound of the input instead of its count: the
    setting allows it and the model's tokenizer has a proven bound.  The bound found must then
    be within the model's input limit (:func:`bound_within`), the plan on it settle to actual
    figures, and the counters have room (:func:`output_room_needed`, the room tracker)."""
    return enabled and proven_bound


def bound_within(bound: int, max_input_tokens: int | None) -> bool:
    """A bound admission may decide on: within the model's input limit (when it has one); a
    request whose bound is beyond it is admitted on its exact count instead."""
    return max_input_tokens is None or bound <= max_input_tokens


def output_room_needed(buckets: list[WindowedBucket], cost: Cost) -> dict[str, int] | None:
    """For a request admitted on a bound: the units per counter its whole output needs on top
    of the bound (a metered stream charges its output as it goes, against counters that hold
    the bound until settlement, so its cut must not come earlier); None for a request whose
    output is not metered as it streams (a non-stream sent as one reserved its whole output)."""
    if not cost.meter_stream or cost.upstream_stream:
        return None
    return {b.key: b.rates.output_units(cost.effective_max_output) for b in buckets}


def lease_ms(*, settle_to_actual: bool, holds_slots: bool, records: bool, lease: int) -> int:
    """How long an admission is leased (0: not leased): a reservation to settle, a
    concurrency slot to free or a usage record to write are leased, so that the tenant's next
    admission gives the first two back and writes the record if this processor dies."""
    return lease if (settle_to_actual or holds_slots or records) else 0


def bound_excess_refund(
    buckets: tuple[WindowedBucket, ...] | list[WindowedBucket], bound: Cost, exact: int
) -> tuple[tuple[str, int], ...]:
    """What a reclaim may refund on each per-token counter of a request admitted on ``bound``
    once its exact input is known: what admission charged beyond the exact count (nothing
    when the exact count is not below the bound)."""
    if exact >= bound.input_tokens:
        return ()
    counted = replace(bound, input_tokens=exact)
    return tuple(
        (
            b.key,
            admission_plan.admission_amount(b, bound) - admission_plan.admission_amount(b, counted),
        )
        for b in buckets
        if b.kind == "tpm"
    )


def counts_refusal(*, on_bound: bool, configured: bool) -> bool:
    """Whether a refused admission counts against the request-rate limits: as configured,
    except a refusal on a bound, which is asked again on the exact count (counted once,
    there)."""
    return False if on_bound else configured


@dataclass(frozen=True, slots=True)
class Billed:
    """A usage record's figures: input and output tokens, and the money (None: unpriced)."""

    input: int
    output: int
    money: Decimal | None


def reclaimed_billing(
    *,
    charged: int,
    draft_input: int,
    reserved_output: int,
    noted_input: int,
    prices: Rates | None,
) -> Billed:
    """The billing record of a request whose processor died before settling it, from its
    ledger as the reclaim handed it back: its input the exact count its processor noted
    (``noted_input`` >= 0), else the draft's figure; its output what the ledger charged beyond
    the draft's input and reservation (the reservation went back with the reclaim); its money
    the prices of that usage."""
    inp = noted_input if noted_input >= 0 else draft_input
    out = max(0, charged - draft_input - reserved_output)
    money = None if prices is None else Decimal(prices.units(Usage(input=inp, output=out)))
    return Billed(inp, out, None if money is None else money.scaleb(-6))


# -- policies beside the limits --------------------------------------------------------------


def fallback_for(
    fallbacks: Mapping[str, Mapping[str, str]],
    *,
    tenant: TenantInfo,
    model: ModelInfo,
    buckets: tuple[WindowedBucket, ...],
    values: tuple[int, ...],
    cost: Cost,
) -> str | None:
    """The plan's fallback model for a refused request, when what refused it was a limit on
    the requested model (a tenant-wide limit would refuse the fallback too)."""
    name = fallbacks.get(tenant.plan, {}).get(model.name)
    if name is None or not model.known:
        return None
    on_model = any(
        b.limit.model == model.name
        and not b.limit.shadow
        and admission_plan.would_refuse(b, v, admission_plan.admission_amount(b, cost))
        for b, v in zip(buckets, values, strict=True)
    )
    return name if on_model else None


@dataclass(frozen=True, slots=True)
class ShadowOutcome:
    """Each limit kind's decision at admission (``(metric, decision)`` to count) and the shadow
    limits that would have refused the request."""

    decisions: tuple[tuple[str, str], ...]
    exceeded: tuple[str, ...]

    def headers(self) -> tuple[tuple[str, str], ...]:
        """``x-ratelimit-shadow-exceeded`` naming the shadow limits that would have refused."""
        if not self.exceeded:
            return ()
        return (("x-ratelimit-shadow-exceeded", "; ".join(self.exceeded)),)


def shadow_outcome(
    buckets: tuple[WindowedBucket, ...], values: tuple[int, ...], cost: Cost
) -> ShadowOutcome:
    """Shadow limits are counted and reported, never enforced: which would have refused."""
    kinds: set[str] = set()
    decisions: list[tuple[str, str]] = []
    exceeded: list[str] = []
    for b, v in zip(buckets, values, strict=True):
        if not b.limit.shadow:
            kinds.add(b.metric)
            continue
        # values are after charging: over the limit means this admission would have been refused
        if v > b.limit.limit and admission_plan.admission_amount(b, cost) > 0:
            exceeded.append(admission_plan.describe(b.limit))
            decisions.append((b.metric, "shadow_refused"))
        else:
            decisions.append((b.metric, "shadow_allowed"))
    decisions += [(kind, "allowed") for kind in sorted(kinds)]
    return ShadowOutcome(tuple(decisions), tuple(exceeded))
