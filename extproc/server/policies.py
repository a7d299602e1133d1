"""Policies beside the limits themselves: shadow limits (counted, reported, never enforced) and
the fallback model served instead of a 429 (docs/semantics.md, "Budgets and policies")."""

from __future__ import annotations

import structlog

from extproc.config.runtime import Model
from extproc.core import admission
from extproc.core.admission import Cost
from extproc.server.context import RequestContext
from extproc.server.gateway import Gateway

log = structlog.get_logger("extproc")


def shadow_report(
    gw: Gateway, ctx: RequestContext, values: tuple[int, ...], cost: Cost
) -> list[tuple[str, str]]:
    """Count each limit kind's decision; a shadow limit that would have refused is logged
    and named in ``x-ratelimit-shadow-exceeded`` (the request goes on)."""
    kinds: set[str] = set()
    exceeded: list[str] = []
    for b, v in zip(ctx.buckets, values, strict=True):
        if not b.limit.shadow:
            kinds.add(b.metric)
            continue
        # values are after charging: over the limit means this admission would have been refused
        if v > b.limit.limit and admission.admission_amount(b, cost) > 0:
            exceeded.append(admission.describe(b.limit))
            gw.metrics.limit_decisions.labels(b.metric, "shadow_refused").inc()
        else:
            gw.metrics.limit_decisions.labels(b.metric, "shadow_allowed").inc()
    for kind in kinds:
        gw.metrics.limit_decisions.labels(kind, "allowed").inc()
    if not exceeded:
        return []
    log.info(
        "shadow_limit_exceeded",
        request_id=ctx.request_id,
        tenant=ctx.tenant.id if ctx.tenant else None,
        limits=exceeded,
        would="refuse",
    )
    return [("x-ratelimit-shadow-exceeded", "; ".join(exceeded))]


def fallback_model(ctx: RequestContext, cost: Cost, values: tuple[int, ...]) -> Model | None:
    """The plan's fallback for the requested model, when what refused it was a limit on that
    model (a tenant-wide limit would refuse the fallback too)."""
    model, tenant = ctx.model, ctx.tenant
    assert model is not None and tenant is not None
    name = ctx.cfg.fallbacks.get(tenant.plan, {}).get(model.name)
    if name is None or not model.known:
        return None
    on_model = any(
        b.limit.model == model.name
        and not b.limit.shadow
        and admission.would_refuse(b, v, admission.admission_amount(b, cost))
        for b, v in zip(ctx.buckets, values, strict=True)
    )
    return ctx.cfg.models.get(name) if on_model else None
