"""Request body: parse, count input tokens (:mod:`extproc.server.counting`), plan the cost, run
the one admission call; a refusal by a limit on the requested model may be served by the plan's
fallback model (decided by :func:`extproc.core.policies.fallback_for`).  A call that timed out,
or was cancelled (the request went away), keeps a cancel.  What the answers mean is decided in
the core; this module makes the calls."""

from __future__ import annotations

import asyncio
import contextvars
import time
from dataclasses import dataclass
from typing import Literal

import structlog

from extproc.config.runtime import Model, RuntimeConfig
from extproc.core import admission, policies
from extproc.core.admission import Cost
from extproc.core.apis.base import RequestLimits
from extproc.core.counters import UTF8BoundCounter
from extproc.core.figures import run_ahead_budget
from extproc.core.keys import WindowedBucket
from extproc.core.policies import ShadowOutcome, fallback_for, shadow_outcome
from extproc.core.records import Admitted, Parsed
from extproc.core.rules import Adjustment, Charging
from extproc.core.session import Session
from extproc.errors import (
    BadRequest,
    LimiterUnavailable,
    QuotaExceeded,
    RequestTooLarge,
    UnknownModel,
)
from extproc.gateway import Gateway
from extproc.limiter.base import AdmitResult
from extproc.limiter.kept import Kept
from extproc.records.model import RecordDraft
from extproc.server.counting import bound_input, count_input
from extproc.server.reclaim import record_reclaimed

log = structlog.get_logger("extproc")


async def admit_body(
    gw: Gateway, cfg: RuntimeConfig, s: Session, raw: bytes, started: float
) -> bytes | None:
    """Admit the request (raise a :class:`GatewayError` when not); the body to forward."""
    api, tenant, key = s.api, s.tenant, s.key
    assert api is not None and tenant is not None and key is not None
    if len(raw) > cfg.max_body_bytes:
        raise RequestTooLarge(
            f"the request body is {len(raw)} bytes; the limit is {cfg.max_body_bytes}"
        )
    limits = RequestLimits(max_tokens_ceiling=cfg.max_tokens_ceiling, max_n=cfg.max_n)
    try:
        req = api.parse(raw, limits)
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    model = cfg.resolve_model(req.model)
    if model is None:
        if cfg.unknown_model_action == "reject":
            raise UnknownModel(
                f"The model '{req.model[:100]}' does not exist or you do not have access to it.",
                status=cfg.unknown_model_status,
            )
        model = cfg.unknown_model
    s.parse(Parsed(req, model))
    attempt = await _attempt(gw, cfg, s, model, len(raw))
    fallback_headers: tuple[tuple[str, str], ...] = ()
    if attempt.refused is not None:
        # A limit on the requested model is exhausted: the plan may name another model that
        # still has room (its own buckets are charged; the client is told in a header).
        name = fallback_for(
            cfg.fallbacks,
            tenant=tenant,
            model=model,
            buckets=attempt.buckets,
            values=attempt.values,
            cost=attempt.plan.cost,
        )
        alt = cfg.models.get(name) if name is not None else None
        if alt is None:
            raise attempt.refused
        s.parse(Parsed(req, alt))
        second = await _attempt(gw, cfg, s, alt, len(raw))
        if second.refused is not None:
            s.parse(Parsed(req, model))
            raise attempt.refused
        gw.metrics.limit_decisions.labels(attempt.refused.metric, "fallback").inc()
        log.info(
            "fallback",
            request_id=s.request_id,
            requested=model.name,
            fallback=alt.name,
            reason=attempt.refused.code,
        )
        fallback_headers = (
            ("x-aiquota-fallback-model", alt.name),
            ("x-aiquota-requested-model", model.name),
        )
        attempt, model = second, alt
    cost = attempt.plan.cost if attempt.result is not None else None
    headers = fallback_headers
    budget = attempt.plan.budget
    if attempt.result is not None:
        budget = run_ahead_budget(
            budget,
            buckets=attempt.buckets,
            values=attempt.result.values,
            cost=attempt.plan.cost,
            sequences=req.sequences,
        )
        values = attempt.result.values
        headers += tuple(
            admission.rate_limit_headers(list(attempt.buckets), values, attempt.now).as_pairs()
        )
        shadow = shadow_outcome(attempt.buckets, values, attempt.plan.cost)
        headers += _report_shadow(gw, s, shadow)
    floor = 0
    if attempt.on_bound and isinstance(model.bound_counter, UTF8BoundCounter):
        floor = model.bound_counter.fewest_tokens(attempt.input_tokens)
    s.admit(
        Admitted(
            model,
            cost,
            attempt.buckets,
            attempt.now,
            headers,
            input_bound=attempt.on_bound,
            input_floor=floor,
        ),
        admission.admission_usage(cost) if cost is not None else None,
    )
    gw.metrics.decisions.labels("admitted", "ok").inc()
    gw.metrics.admission_seconds.observe(time.perf_counter() - started)
    log.info(
        "decision",
        tenant=tenant.id,
        key=key.name,
        model=model.name,
        api=api.name,
        input_tokens=attempt.input_tokens,
        input_counted="after" if attempt.on_bound else "before",
        reserved_output=attempt.plan.cost.reserved_output,
        stream=req.stream,
        decision="admitted" if attempt.result is not None else "admitted_unmetered",
        mode=attempt.charging.mode,
        streaming=attempt.charging.streaming,
        latency_ms=round((time.perf_counter() - started) * 1000, 3),
    )
    return api.rewrite(
        req,
        budget=budget,
        force_usage=cfg.force_include_usage and attempt.plan.cost.meter_stream,
        model=model.name if model.known else None,
        continuous_usage=model.continuous_usage and attempt.plan.cost.meter_stream,
    )


def _report_shadow(gw: Gateway, s: Session, shadow: ShadowOutcome) -> tuple[tuple[str, str], ...]:
    """Count the shadow decisions; log the shadow limits that would have refused."""
    for metric, decision in shadow.decisions:
        gw.metrics.limit_decisions.labels(metric, decision).inc()
    if shadow.exceeded:
        log.info(
            "shadow_limit_exceeded",
            request_id=s.request_id,
            tenant=s.tenant.id if s.tenant else None,
            limits=list(shadow.exceeded),
            would="refuse",
        )
    return shadow.headers()


@dataclass(slots=True)
class _Attempt:
    """Admission of the request as one model: the plan, the buckets, the answer (None:
    fail-open) and the refusal when refused."""

    plan: admission.AdmissionPlan
    charging: Charging
    input_tokens: int
    buckets: tuple[WindowedBucket, ...]
    now: int
    result: AdmitResult | None = None
    refused: QuotaExceeded | None = None
    values: tuple[int, ...] = ()
    on_bound: bool = False  # admitted on an upper bound of the input: count exactly after


async def _attempt(
    gw: Gateway, cfg: RuntimeConfig, s: Session, model: Model, size: int
) -> _Attempt:
    """Plan and run the one admission call as ``model``: on an upper bound of the input where
    the counters have ample room (:func:`_on_bound`), otherwise on the exact count.  A bound
    the limiter refuses is counted exactly and asked again: the bound never turns an answer."""
    api, req, tenant = s.api, s.req, s.tenant
    assert api is not None and req is not None and tenant is not None
    structlog.contextvars.bind_contextvars(tenant=tenant.id, model=model.name)
    charging = cfg.charging_for(tenant.plan, model.name)
    bound = _on_bound(gw, cfg, s, model, charging)
    if bound is not None:
        plan, now, buckets = bound
        out = await _call(
            gw, cfg, s, model, plan, charging=charging, on_bound=True, at=(now, buckets)
        )
        if out.refused is None:
            gw.metrics.input_admissions.labels("bound").inc()
            return out
        gw.metrics.input_admissions.labels("recounted").inc()
    else:
        gw.metrics.input_admissions.labels("exact").inc()
    exact = await count_input(gw, cfg, api, req, model, size=size)
    plan = _plan(s, model, charging, exact, cfg.over_model_cap)
    return await _call(gw, cfg, s, model, plan, charging=charging)


def _plan(
    s: Session,
    model: Model,
    charging: Charging,
    input_tokens: int,
    over_cap: Literal["clamp", "reject"],
) -> admission.AdmissionPlan:
    """The admission plan of ``input_tokens`` (raises the client's 400/413 on limits)."""
    req, api = s.req, s.api
    assert req is not None and api is not None
    return admission.plan_admission(
        declared_max_output=req.declared_max_output,
        sequences=req.sequences,
        stream=req.stream and api.can_stream,
        input_tokens=input_tokens,
        model_name=model.name,
        model_cap=model.max_output_tokens,
        max_input_tokens=model.max_input_tokens,
        over_cap=over_cap,
        budget_param=req.budget_fields[0] if req.budget_fields else "max_tokens",
        charging=charging,
    )


def _on_bound(
    gw: Gateway, cfg: RuntimeConfig, s: Session, model: Model, charging: Charging
) -> tuple[admission.AdmissionPlan, int, list[WindowedBucket]] | None:
    """The plan on an upper bound of the input, when admission may decide on it: the model's
    tokenizer has a proven bound, the bound is within the model's input limit, the request
    settles to its actual figures (a final-at-admission charge would keep the bound), and every
    per-token counter was last seen with ``bound_headroom`` times the charge free (and, for a
    metered stream, its whole output besides); with the time and buckets it was judged at."""
    api, req = s.api, s.req
    assert api is not None and req is not None
    if not policies.may_admit_on_bound(
        enabled=cfg.admit_on_bound, proven_bound=model.bound_counter is not None
    ):
        return None
    bound = bound_input(api, req, model)
    if bound is None or not policies.bound_within(bound, model.max_input_tokens):
        return None
    plan = _plan(s, model, charging, bound, cfg.over_model_cap)
    if not plan.cost.settle_to_actual:
        return None
    now = gw.clock.now_ms()
    buckets = s.buckets_at(gw.key_prefix, now, cfg.reservation_lease_ms)
    cost = plan.cost
    later = policies.output_room_needed(buckets, cost)
    charges = admission.admission_charges(buckets, cost)
    if not gw.room.ample(charges, cfg.bound_headroom, later, share=cfg.bound_below):
        return None
    return plan, now, buckets


async def _call(
    gw: Gateway,
    cfg: RuntimeConfig,
    s: Session,
    model: Model,
    plan: admission.AdmissionPlan,
    *,
    charging: Charging,
    on_bound: bool = False,
    at: tuple[int, list[WindowedBucket]] | None = None,
) -> _Attempt:
    """Run the one admission call of ``plan`` (``at``: the time and buckets it was planned
    at, else now's)."""
    api, tenant, key = s.api, s.tenant, s.key
    assert api is not None and tenant is not None and key is not None
    cost = plan.cost
    input_tokens = cost.input_tokens
    if at is None:
        now = gw.clock.now_ms()
        at = now, s.buckets_at(gw.key_prefix, now, cfg.reservation_lease_ms)
    now, buckets = at[0], tuple(at[1])
    # Leased: a reservation to settle, a concurrency slot to free, or a usage record to write
    # (the tenant's next admission gives the first two back and writes the record if this
    # processor dies).
    records = gw.recorder is not None
    lease = policies.lease_ms(
        settle_to_actual=cost.settle_to_actual,
        holds_slots=any(b.kind == "concurrency" for b in buckets),
        records=records,
        lease=cfg.reservation_lease_ms,
    )
    draft = ""
    if lease and records:
        draft = RecordDraft(
            request_id=s.request_id,
            tenant=tenant.id,
            key=key.name,
            model=model.name,
            api=api.name,
            input_tokens=input_tokens,
            reserved_output=cost.reserved_output if cost.settle_to_actual else 0,
            admitted_at_ms=now,
        ).to_json()
    res = await limiter_admit(
        gw,
        cfg,
        s,
        list(buckets),
        cost,
        now_ms=now,
        lease_until_ms=now + lease if lease else 0,
        record_draft=draft,
        count_refused=policies.counts_refusal(
            on_bound=on_bound, configured=cfg.count_refused_requests
        ),
    )
    out = _Attempt(plan, charging, input_tokens, buckets, now, res, on_bound=on_bound)
    if res is not None and not res.admitted and not res.duplicate:
        err = admission.refusal(
            list(buckets), res.values, cost, now, tenant=tenant.id, model=model.name
        )
        if not on_bound:
            gw.metrics.limit_decisions.labels(err.metric, "refused").inc()
        out.refused = err
        out.values = res.values
    elif res is not None:
        # A duplicate can only be our own retried call (ledger ids are unique per HTTP
        # request): the first execution charged, so the request is admitted and metered.
        if res.duplicate:
            gw.metrics.duplicate_hits.labels("admit").inc()
        if lease:
            gw.keep_leases()
    return out


async def admit_rpm_only(gw: Gateway, cfg: RuntimeConfig, s: Session) -> None:
    """An unmetered path under ``paths.other: rpm_only``: one request on the RPM buckets."""
    tenant, key = s.tenant, s.key
    assert tenant is not None and key is not None
    now = gw.clock.now_ms()
    limits = tuple(lim for lim in tenant.limits if lim.metric == "rpm" and lim.model == "*")
    buckets = admission.buckets_for(
        prefix=gw.key_prefix,
        tenant=tenant.id,
        key_name=key.name,
        model="*",
        limits=limits,
        now_ms=now,
    )
    if not buckets:
        return
    res = await limiter_admit(gw, cfg, s, buckets, admission.RPM_ONLY)
    if res is not None and not res.admitted and not res.duplicate:
        raise admission.refusal(
            buckets, res.values, admission.RPM_ONLY, now, tenant=tenant.id, model="*"
        )


def _keep_cancel(
    gw: Gateway, cfg: RuntimeConfig, s: Session, buckets: list[WindowedBucket], cost: Cost
) -> None:
    """Undo an admission whose call timed out, if it ran after all, once Redis answers."""
    undo = [
        Adjustment(c.key, -c.amount, c.expire_at_ms)
        for c in admission.admission_charges(buckets, cost)
        if c.kind != "concurrency" and c.amount
    ]
    ttl = cfg.ledger_ttl_seconds * 1000
    gw.settlements.keep(Kept(s.ledger, undo, ttl, s.request_id, cancel=True))


async def limiter_admit(
    gw: Gateway,
    cfg: RuntimeConfig,
    s: Session,
    buckets: list[WindowedBucket],
    cost: Cost,
    *,
    now_ms: int = 0,
    lease_until_ms: int = 0,
    record_draft: str = "",
    count_refused: bool | None = None,
) -> AdmitResult | None:
    """Run admission; None means Redis failed and the plan's policy is fail-open.  Requests
    of dead processors the call reclaimed get their usage records here."""
    charges = admission.admission_charges(buckets, cost)
    if gw.settlements_full():
        # Redis has not taken the settlements of the requests admitted before: admitting more
        # would pile up more (dropping one would lose a correction), so push back.
        open_ = policies.fails_open(cfg.failure_mode_for(s.plan))
        gw.metrics.settlement_pushback.labels("unmetered" if open_ else "refused").inc()
        log.warning("settlement_backlog_full", request_id=s.request_id, fail_open=open_)
        if open_:
            return None
        raise LimiterUnavailable(
            "the quota backend (Redis) is behind with settlements; retry shortly"
        )
    # Settlements waiting for their batch ride on this call (applied first, at no extra round
    # trip); whatever happens to the call, they go back to the batcher (applied or not).
    riders = gw.riders_for(s.ledger)
    done: AdmitResult | None = None
    try:
        res = await gw.limiter.admit(
            s.ledger,
            charges,
            tpm_charged=cost.tpm_amount,
            count_refused=(
                policies.counts_refusal(on_bound=False, configured=cfg.count_refused_requests)
                if count_refused is None
                else count_refused
            ),
            ledger_ttl_ms=cfg.ledger_ttl_seconds * 1000,
            now_ms=now_ms,
            lease_until_ms=lease_until_ms,
            record_draft=record_draft,
            settlements=riders,
        )
        done = res
    except asyncio.CancelledError:
        # The request went away while its call was out: the script may run (or have run)
        # all the same.  The cancel undoes it if it did, or stops it from ever running.
        _keep_cancel(gw, cfg, s, buckets, cost)
        raise
    except LimiterUnavailable as exc:
        gw.metrics.limiter_errors.labels("admit").inc()
        # The call may still run once Redis answers (it timed out, it did not fail): keep a
        # cancel that undoes it if it ran, or stops it from ever running.
        if exc.maybe_ran:
            _keep_cancel(gw, cfg, s, buckets, cost)
        if policies.fails_open(cfg.failure_mode_for(s.plan)):
            log.warning("limiter_unavailable_fail_open", request_id=s.request_id)
            return None
        raise
    finally:
        if riders:
            gw.riders_done(riders, done)
    gw.room.note(charges, res.values)
    if res.reclaimed:
        # Other requests' records: written after this request's answer is on its way, in a
        # context of their own (their log lines do not carry this request's fields).
        asyncio.get_running_loop().call_soon(
            record_reclaimed, gw, cfg, res.reclaimed, context=contextvars.Context()
        )
    return res
