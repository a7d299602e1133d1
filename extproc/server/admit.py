"""Request body: parse, count input tokens (:mod:`extproc.server.counting`), plan the cost, run
the one admission call; a refusal by a limit on the requested model may be served by the plan's
fallback model (:mod:`extproc.server.policies`).  A call that timed out keeps a cancel."""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

from extproc.config.runtime import Model
from extproc.core import admission
from extproc.core.admission import Cost
from extproc.core.apis.base import RequestLimits
from extproc.core.keys import WindowedBucket, ledger_key
from extproc.core.rules import Adjustment, Charging
from extproc.errors import (
    BadRequest,
    LimiterUnavailable,
    QuotaExceeded,
    RequestTooLarge,
    UnknownModel,
)
from extproc.limiter.base import AdmitResult
from extproc.records.model import RecordDraft
from extproc.server.context import RequestContext
from extproc.server.counting import count_input
from extproc.server.gateway import Gateway
from extproc.server.kept import Kept
from extproc.server.policies import fallback_model, shadow_report
from extproc.server.reclaim import record_reclaimed

log = structlog.get_logger("extproc")


def buckets_at(gw: Gateway, ctx: RequestContext, now_ms: int) -> list[WindowedBucket]:
    """The request's buckets in the windows containing ``now_ms``."""
    assert ctx.tenant is not None and ctx.key is not None and ctx.model is not None
    model_key = ctx.model.name if ctx.model.known else (ctx.req.model if ctx.req else "*")
    return admission.buckets_for(
        prefix=gw.key_prefix,
        tenant=ctx.tenant.id,
        key_name=ctx.key.name,
        model=model_key,
        limits=ctx.tenant.limits,
        now_ms=now_ms,
        prices=ctx.model.prices,
        lease_ms=ctx.cfg.reservation_lease_ms,
    )


async def admit_body(gw: Gateway, ctx: RequestContext, raw: bytes) -> bytes | None:
    """Admit the request (raise a :class:`GatewayError` when not); the body to forward."""
    cfg = ctx.cfg
    api = ctx.api
    assert api is not None and ctx.tenant is not None and ctx.key is not None
    if len(raw) > cfg.max_body_bytes:
        raise RequestTooLarge(
            f"the request body is {len(raw)} bytes; the limit is {cfg.max_body_bytes}"
        )
    limits = RequestLimits(max_tokens_ceiling=cfg.max_tokens_ceiling, max_n=cfg.max_n)
    try:
        req = api.parse(raw, limits)
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    ctx.req = req
    model = cfg.resolve_model(req.model)
    if model is None:
        if cfg.unknown_model_action == "reject":
            raise UnknownModel(
                f"The model '{req.model[:100]}' does not exist or you do not have access to it.",
                status=cfg.unknown_model_status,
            )
        model = cfg.unknown_model
    ctx.ledger = ledger_key(gw.key_prefix, ctx.tenant.id, gw.ledger_id(ctx.request_id))
    attempt = await _attempt(gw, ctx, model, len(raw))
    if attempt.refused is not None:
        # A limit on the requested model is exhausted: the plan may name another model that
        # still has room (its own buckets are charged; the client is told in a header).
        alt = fallback_model(ctx, attempt.plan.cost, attempt.values)
        if alt is None:
            raise attempt.refused
        second = await _attempt(gw, ctx, alt, len(raw))
        if second.refused is not None:
            raise attempt.refused
        gw.metrics.limit_decisions.labels(attempt.refused.metric, "fallback").inc()
        log.info(
            "fallback",
            request_id=ctx.request_id,
            requested=model.name,
            fallback=alt.name,
            reason=attempt.refused.code,
        )
        ctx.headers_out += [
            ("x-aiquota-fallback-model", alt.name),
            ("x-aiquota-requested-model", model.name),
        ]
        attempt, model = second, alt
    plan, charging, input_tokens, decision = (
        attempt.plan,
        attempt.charging,
        attempt.input_tokens,
        attempt.decision,
    )
    cost = plan.cost
    gw.metrics.decisions.labels("admitted", "ok").inc()
    gw.metrics.admission_seconds.observe(time.perf_counter() - ctx.started)
    log.info(
        "decision",
        tenant=ctx.tenant.id,
        key=ctx.key.name,
        model=model.name,
        api=api.name,
        input_tokens=input_tokens,
        reserved_output=cost.reserved_output,
        stream=req.stream,
        decision=decision,
        mode=charging.mode,
        streaming=charging.streaming,
        latency_ms=ctx.latency_ms(),
    )
    return api.rewrite(
        req,
        budget=plan.budget,
        force_usage=cfg.force_include_usage and cost.meter_stream,
        model=model.name if model.known else None,
    )


@dataclass(slots=True)
class _Attempt:
    """Admission of the request as one model: the plan, and the refusal when refused."""

    plan: admission.AdmissionPlan
    charging: Charging
    input_tokens: int
    decision: str = "admitted"
    refused: QuotaExceeded | None = None
    values: tuple[int, ...] = ()


async def _attempt(gw: Gateway, ctx: RequestContext, model: Model, size: int) -> _Attempt:
    """Count, plan and run the one admission call as ``model`` (sets ``ctx.model`` and, when
    admitted, the cost, buckets, account and headers)."""
    cfg, api, req, tenant = ctx.cfg, ctx.api, ctx.req, ctx.tenant
    assert api is not None and req is not None and tenant is not None
    ctx.model = model
    structlog.contextvars.bind_contextvars(tenant=tenant.id, model=model.name)
    input_tokens = await count_input(gw, ctx, size)
    charging = cfg.charging_for(tenant.plan, model.name)
    budget_param = req.budget_fields[0] if req.budget_fields else "max_tokens"
    plan = admission.plan_admission(
        declared_max_output=req.declared_max_output,
        sequences=req.sequences,
        stream=req.stream and api.can_stream,
        input_tokens=input_tokens,
        model_name=model.name,
        model_cap=model.max_output_tokens,
        max_input_tokens=model.max_input_tokens,
        over_cap=cfg.over_model_cap,
        budget_param=budget_param,
        charging=charging,
    )
    cost = plan.cost
    now = gw.clock.now_ms()
    ctx.buckets = buckets_at(gw, ctx, now)
    # Leased: a reservation to settle, a concurrency slot to free, or a usage record to write
    # (the tenant's next admission gives the first two back and writes the record if this
    # processor dies).
    records = gw.recorder is not None
    leased = cost.settle_to_actual or ctx.holds_slots or records
    lease = cfg.reservation_lease_ms if leased else 0
    draft = ""
    if lease and records and ctx.key is not None and api is not None:
        draft = RecordDraft(
            request_id=ctx.request_id,
            tenant=tenant.id,
            key=ctx.key.name,
            model=model.name,
            api=api.name,
            input_tokens=input_tokens,
            reserved_output=cost.reserved_output if cost.settle_to_actual else 0,
            admitted_at_ms=now,
        ).to_json()
    res = await limiter_admit(
        gw,
        ctx,
        ctx.buckets,
        cost,
        now_ms=now,
        lease_until_ms=now + lease if lease else 0,
        record_draft=draft,
    )
    out = _Attempt(plan, charging, input_tokens)
    if res is None:  # fail-open: Redis is down and the plan lets traffic through unmetered
        out.decision = "admitted_unmetered"
    elif not res.admitted and not res.duplicate:
        err = admission.refusal(
            ctx.buckets, res.values, cost, now, tenant=tenant.id, model=model.name
        )
        gw.metrics.limit_decisions.labels(err.metric, "refused").inc()
        out.refused = err
        out.values = res.values
    else:
        # A duplicate can only be our own retried call (ledger ids are unique per HTTP
        # request): the first execution charged, so the request is admitted and metered.
        if res.duplicate:
            gw.metrics.duplicate_hits.labels("admit").inc()
        ctx.cost = cost
        ctx.admitted_at_ms = now
        ctx.account.record(ctx.buckets, admission.admission_usage(cost))
        ctx.headers_out += admission.rate_limit_headers(ctx.buckets, res.values, now).as_pairs()
        ctx.headers_out += shadow_report(gw, ctx, res.values, cost)
        if lease:
            gw.keep_leases()
    return out


async def admit_rpm_only(gw: Gateway, ctx: RequestContext) -> None:
    """An unmetered path under ``paths.other: rpm_only``: one request on the RPM buckets."""
    assert ctx.tenant is not None and ctx.key is not None
    now = gw.clock.now_ms()
    limits = tuple(lim for lim in ctx.tenant.limits if lim.metric == "rpm" and lim.model == "*")
    buckets = admission.buckets_for(
        prefix=gw.key_prefix,
        tenant=ctx.tenant.id,
        key_name=ctx.key.name,
        model="*",
        limits=limits,
        now_ms=now,
    )
    if not buckets:
        return
    ctx.ledger = ledger_key(gw.key_prefix, ctx.tenant.id, gw.ledger_id(ctx.request_id))
    res = await limiter_admit(gw, ctx, buckets, admission.RPM_ONLY)
    if res is not None and not res.admitted and not res.duplicate:
        raise admission.refusal(
            buckets, res.values, admission.RPM_ONLY, now, tenant=ctx.tenant.id, model="*"
        )


def _keep_cancel(
    gw: Gateway, ctx: RequestContext, buckets: list[WindowedBucket], cost: Cost
) -> None:
    """Undo an admission whose call timed out, if it ran after all, once Redis answers."""
    undo = [
        Adjustment(c.key, -c.amount, c.expire_at_ms)
        for c in admission.admission_charges(buckets, cost)
        if c.kind != "concurrency" and c.amount
    ]
    ttl = ctx.cfg.ledger_ttl_seconds * 1000
    gw.settlements.keep(Kept(ctx.ledger, undo, ttl, ctx.request_id, cancel=True))


async def limiter_admit(
    gw: Gateway,
    ctx: RequestContext,
    buckets: list[WindowedBucket],
    cost: Cost,
    *,
    now_ms: int = 0,
    lease_until_ms: int = 0,
    record_draft: str = "",
) -> AdmitResult | None:
    """Run admission; None means Redis failed and the plan's policy is fail-open.  Requests
    of dead processors the call reclaimed get their usage records here."""
    try:
        res = await gw.limiter.admit(
            ctx.ledger,
            admission.admission_charges(buckets, cost),
            tpm_charged=cost.tpm_amount,
            count_refused=ctx.cfg.count_refused_requests,
            ledger_ttl_ms=ctx.cfg.ledger_ttl_seconds * 1000,
            now_ms=now_ms,
            lease_until_ms=lease_until_ms,
            record_draft=record_draft,
        )
    except LimiterUnavailable as exc:
        gw.metrics.limiter_errors.labels("admit").inc()
        # The call may still run once Redis answers (it timed out, it did not fail): keep a
        # cancel that undoes it if it ran, or stops it from ever running.
        if exc.maybe_ran:
            _keep_cancel(gw, ctx, buckets, cost)
        if ctx.cfg.failure_mode_for(ctx.plan) == "open":
            log.warning("limiter_unavailable_fail_open", request_id=ctx.request_id)
            return None
        raise
    if res.reclaimed:
        record_reclaimed(gw, ctx.cfg, res.reclaimed)
    return res
