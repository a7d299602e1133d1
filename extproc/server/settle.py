"""Settlement: once per request, whatever its ending, charge what was generated and refund the
rest; settlements Redis could not take are kept and retried until it answers.

What "generated" means per ending (docs/semantics.md):

* a stream: the upstream's usage when the stream completed and the figure is within bounds,
  otherwise the tokens the meter counted (delivered tokens when the gateway cut it);
* a JSON response: its usage within bounds; the reservation when it carries none;
* a non-2xx response: nothing (input included);
* a request abandoned before its response (client gone, Envoy reset, the processor stopping):
  input plus what the upstream could have generated while it ran, at
  ``ABANDONED_TOKENS_PER_SECOND`` per sequence, never more than was reserved.
"""

from __future__ import annotations

import math
from decimal import Decimal

import structlog

from extproc.core.lifecycle import Ending, Lifecycle
from extproc.core.rules import Adjustment, Usage
from extproc.errors import LimiterUnavailable
from extproc.records.model import UsageRecord, record_id_for
from extproc.server.admit import buckets_at
from extproc.server.context import RequestContext
from extproc.server.gateway import Gateway
from extproc.server.kept import Kept

log = structlog.get_logger("extproc")

# Usage below the counted output by more than this share (plus a few tokens) is not trusted.
USAGE_TOLERANCE = 0.02
USAGE_SLACK_TOKENS = 8
ABANDONED_TOKENS_PER_SECOND = 200


def bounded_usage(gw: Gateway, ctx: RequestContext, reported: int, counted: int) -> int:
    """The upstream's output figure, trusted within [counted - tolerance, what could be made]."""
    low = max(0, math.floor(counted * (1 - USAGE_TOLERANCE)) - USAGE_SLACK_TOKENS)
    high = ctx.cost.effective_max_output if ctx.cost else reported
    if reported < low or reported > high:
        direction = "low" if reported < low else "high"
        gw.metrics.usage_disagreements.labels(direction).inc()
        log.warning(
            "usage_disagreement",
            request_id=ctx.request_id,
            tenant=ctx.tenant.id if ctx.tenant else None,
            reported=reported,
            counted=counted,
            bound=low if direction == "low" else high,
        )
        return max(counted, low) if direction == "low" else high
    return reported


def abandoned_output(gw: Gateway, ctx: RequestContext) -> int:
    """Output an upstream could have generated for a request abandoned before its response."""
    cost, req = ctx.cost, ctx.req
    assert cost is not None
    seconds = max(0, gw.clock.now_ms() - ctx.admitted_at_ms) / 1000.0
    sequences = max(1, req.sequences if req else 1)
    return min(cost.reserved_output, math.ceil(seconds * ABANDONED_TOKENS_PER_SECOND * sequences))


def final_total(
    gw: Gateway, ctx: RequestContext, life: Lifecycle, stream_output: int | None
) -> tuple[int | None, int | None]:
    """(TPM total to charge, output tokens) for the ending; (None, None) keeps the charge."""
    cost = ctx.cost
    assert cost is not None
    if ctx.status is not None and not 200 <= ctx.status < 300:
        return 0, 0
    if not cost.settle_to_actual:
        return None, None
    if stream_output is not None:
        out: int | None = stream_output
    elif ctx.usage_output is not None:
        out = ctx.usage_output
    elif life.ending in (
        Ending.CLIENT_DISCONNECTED,
        Ending.UPSTREAM_RESET,
        Ending.SHUTDOWN,
        Ending.INTERNAL_ERROR,
    ):
        out = abandoned_output(gw, ctx)
    else:
        out = None  # a JSON response without usage: the reservation stands
    if out is None:
        return None, None
    return input_tokens(ctx) + out, out


# Server-side state can add at most this much unseen input when the model sets no limit.
UNSEEN_INPUT_CEILING = 1_000_000


def input_tokens(ctx: RequestContext) -> int:
    """Input to charge: the gateway's own count, except for requests carrying server-side state
    it cannot see (``previous_response_id``...), where the upstream's larger figure is used,
    bounded by the model's input limit."""
    cost, req = ctx.cost, ctx.req
    assert cost is not None
    if req is None or not req.notes.get("unseen_input") or ctx.usage_input is None:
        return cost.input_tokens
    ceiling = (ctx.model.max_input_tokens if ctx.model else None) or UNSEEN_INPUT_CEILING
    return max(cost.input_tokens, min(ctx.usage_input, ceiling))


def final_usage(ctx: RequestContext, total: int, output: int | None) -> Usage:
    """The request's final tokens by kind (cached input and reasoning from the upstream's
    usage, within the totals); nothing for a non-2xx answer."""
    if total <= 0:
        return Usage()
    out = max(0, output or 0)
    inp = max(0, total - out)
    requests = ctx.cost.requests if ctx.cost else 1
    return Usage(
        input=inp,
        output=out,
        cached_input=min(ctx.usage_cached_input, inp),
        reasoning=min(ctx.usage_reasoning, out),
        requests=requests,
    )


async def settle(
    gw: Gateway, ctx: RequestContext, life: Lifecycle, stream_output: int | None
) -> None:
    """Settle; the caller calls this once per request (``Lifecycle.begin_settlement``)."""
    ending = life.ending or Ending.COMPLETED
    gw.metrics.endings.labels(ending.value).inc()
    if ctx.cost is None or ctx.tenant is None:
        return
    total, output = final_total(gw, ctx, life, stream_output)
    _record(gw, ctx, ending, total, output)
    if total is None and not ctx.holds_slots:
        _log_settled(ctx, ending, ctx.account.total, 0, output)
        return
    if total is None:  # final at admission; the settlement only frees concurrency slots
        adjustments: list[Adjustment] = []
        total = ctx.account.total
        final = Usage(input=ctx.cost.input_tokens, output=max(0, total - ctx.cost.input_tokens))
    else:
        final = final_usage(ctx, total, output)
        adjustments = ctx.account.adjustments(final, buckets_at(gw, ctx, gw.clock.now_ms()))
    delta = total - ctx.account.total
    # Called even with nothing to correct: the ledger is marked settled, so it is never
    # reclaimed as abandoned and a replay is a no-op.
    ttl = ctx.cfg.ledger_ttl_seconds * 1000
    try:
        if await gw.limiter.settle(
            ctx.ledger, adjustments, ledger_ttl_ms=ttl, unconfirmed=ctx.unconfirmed
        ):
            gw.metrics.settlements.labels("applied").inc()
        else:  # our own retried call found it applied (it never applies twice)
            gw.metrics.duplicate_hits.labels("settle").inc()
    except LimiterUnavailable:
        gw.metrics.limiter_errors.labels("settle").inc()
        gw.settlements.keep(
            Kept(ctx.ledger, adjustments, ttl, ctx.request_id, unconfirmed=ctx.unconfirmed)
        )
        log.warning("settlement_deferred", request_id=ctx.request_id, delta=delta)
    gw.metrics.tokens.labels("net").inc(max(0, total))
    if ctx.model is not None:
        for kind, n in (
            ("input", final.input),
            ("cached_input", final.cached_input),
            ("output", final.output),
            ("reasoning", final.reasoning),
        ):
            if n:
                gw.metrics.model_tokens.labels(ctx.model.name, kind).inc(n)
    _log_settled(ctx, ending, total, delta, output)


def _record(
    gw: Gateway, ctx: RequestContext, ending: Ending, total: int | None, output: int | None
) -> None:
    """The request's billing record, once, at settlement (never blocks: the recorder queues)."""
    if gw.recorder is None or ctx.cost is None or ctx.tenant is None:
        return
    charged = total if total is not None else ctx.account.total
    inp = min(input_tokens(ctx), max(0, charged))  # 0 for a non-2xx: nothing charged
    out = output if output is not None else max(0, charged - inp)
    prices = ctx.model.prices if ctx.model else None
    cost: Decimal | None = None
    if prices is not None and ctx.model is not None and ctx.model.currency:
        micros = prices.units(final_usage(ctx, inp + out if charged > 0 else 0, out))
        cost = Decimal(micros).scaleb(-6)
    gw.recorder.record(
        UsageRecord(
            request_id=ctx.request_id,
            tenant=ctx.tenant.id,
            key=ctx.key.name if ctx.key else "",
            model=ctx.model.name if ctx.model else "",
            api=ctx.api.name if ctx.api else "",
            input_tokens=inp,
            output_tokens=out,
            cached_input_tokens=ctx.usage_cached_input,
            reasoning_tokens=ctx.usage_reasoning,
            cost=cost,
            currency=ctx.model.currency if cost is not None and ctx.model else "",
            ending=ending.value,
            status=ctx.status,
            admitted_at_ms=ctx.admitted_at_ms,
            finished_at_ms=gw.clock.now_ms(),
            record_id=record_id_for(ctx.ledger) if ctx.ledger else "",
        )
    )


def _log_settled(
    ctx: RequestContext, ending: Ending, total: int, delta: int, output: int | None
) -> None:
    log.info(
        "settled",
        request_id=ctx.request_id,
        tenant=ctx.tenant.id if ctx.tenant else None,
        model=ctx.model.name if ctx.model else None,
        ending=ending.value,
        input_tokens=ctx.cost.input_tokens if ctx.cost else None,
        output_tokens=output,
        charged_total=total,
        correction=delta,
        status=ctx.status,
    )
