"""Settlement, executed: once per request, whatever its ending, the core's plan
(:mod:`extproc.core.settlement`, taken through :meth:`extproc.core.session.Session.settlement`)
goes to the limiter as corrections; settlements
Redis could not take are kept and retried until it answers.  Also the request's usage record,
its ``settled`` log line, and the access log's dynamic metadata.

What "generated" means per ending is decided in the core (docs/semantics.md): a stream's usage
within bounds when it completed, else what was delivered; a JSON body's usage within bounds; a
non-2xx answer nothing; an abandoned request what the upstream could have made while it ran.
"""

from __future__ import annotations

from typing import Any

import structlog

from extproc.config.runtime import Model
from extproc.core.envelope import Figures
from extproc.core.figures import Figure
from extproc.core.lifecycle import Ending
from extproc.core.phase_records import StreamEnd
from extproc.core.rules import Adjustment
from extproc.core.session import Session
from extproc.core.settlement import InputAudit, SettlementPlan, asks_abandon_rate
from extproc.errors import LimiterUnavailable
from extproc.gateway import Gateway
from extproc.limiter.base import SettleCall
from extproc.limiter.kept import Kept
from extproc.records.model import UsageRecord, record_id_for
from extproc.server.context import RequestContext

log = structlog.get_logger("extproc")


def access_metadata(s: Session, *, output_tokens: int | None = None) -> dict[str, Any]:
    """The ``ai_quota`` dynamic metadata the access log prints."""
    ending = s.ending
    cost = s.cost
    out: dict[str, Any] = {
        "tenant": s.tenant.id if s.tenant else "",
        "key": s.key.name if s.key else "",
        "model": s.model.name if s.model else "",
        "api": s.api.name if s.api else "",
        "ending": ending.value if ending else "in_progress",
    }
    if not s.input_pending:  # a bound is not a figure: the final metadata carries the count
        out["input_tokens"] = cost.input_tokens if cost else 0
    if output_tokens is not None:
        out["output_tokens"] = output_tokens
        reported = s.reported is not None and s.reported.input is not None
        if cost is not None and (reported or s.input_pending):
            out["input_tokens"] = s.input_tokens()
    return out


def figures_metadata(s: Session, which: Figures) -> dict[str, Any] | None:
    """The access log's figures an answer of the envelope carries (:class:`Figures`)."""
    if which is Figures.NONE:
        return None
    return access_metadata(s, output_tokens=0 if which is Figures.NO_OUTPUT else None)


def log_disagreement(gw: Gateway, s: Session, kind: str, figure: Figure | int) -> None:
    """An upstream figure outside its bounds: counted and logged (the caller calls this once
    per figure: at settlement)."""
    if not isinstance(figure, Figure) or figure.disagreement is None:
        return
    gw.metrics.usage_disagreements.labels(figure.disagreement).inc()
    log.warning(
        "usage_disagreement",
        request_id=s.request_id,
        tenant=s.tenant.id if s.tenant else None,
        figure=kind,
        reported=figure.reported,
        counted=figure.counted,
        bound=figure.bound,
    )


async def settle(ctx: RequestContext, stream: StreamEnd | None, first_chunk_ms: int = 0) -> None:
    """Settle; the caller calls this once per request (``Lifecycle.begin_settlement``).
    ``first_chunk_ms``: when the response's first body chunk arrived (0: none, or a response
    not read chunk by chunk), for the model's learned decode rate.  What settlement does is the
    core's plan (:func:`extproc.core.settlement.settle`); this executes it."""
    gw, cfg, s = ctx.gw, ctx.cfg, ctx.s
    ending = s.ending or Ending.COMPLETED
    gw.metrics.endings.labels(ending.value).inc()
    cost = s.cost
    if cost is None or s.tenant is None:
        return
    now = gw.clock.now_ms()
    model, req = s.model, s.req
    rate: int | None = None
    start = 0
    if model is not None and asks_abandon_rate(ending, stream):
        # what the abandon rule bills at: the model's learned decode rate and time to start
        # a non-stream forwarded as sent decodes at the model's JSON speed; a stream (the
        # client's, or the exact path's) at its streams'
        json = not ((req is not None and req.stream) or cost.upstream_stream)
        rates = gw.decode_rates
        rate, start = rates.abandon(model.name, model.abandoned_tokens_per_second, json=json)
        log.info(
            "abandon_rate",
            request_id=s.request_id,
            model=model.name,
            tokens_per_second=rate,
            start_ms=start,
            learned_from=rates.samples(model.name, json=json),
            json=json,
        )
    plan = s.settlement(
        now,
        stream=stream,
        ending=ending,
        abandon_rate=rate,
        abandon_start_ms=start,
        first_chunk_ms=first_chunk_ms,
        shortcut=isinstance(model, Model) and model.bound_counter is not None,
    )
    sample = plan.decode
    if sample is not None and model is not None:
        rates = gw.decode_rates
        decode_ms = sample.decode_ms
        if sample.less_learned_start:
            decode_ms -= rates.start_ms(model.name)
        rates.observe(model.name, sample.tokens, sample.sequences, decode_ms, sample.start_ms)
    if s.count_failed:  # the bound it was admitted on stands: an over-count, never an under-count
        log.error("input_count_failed", request_id=s.request_id, kept="bound")
    for kind, figure in plan.disagreements():
        log_disagreement(gw, s, kind, figure)
    audit = plan.audit
    if audit is not None:
        _audit_input(gw, s, audit)
    _record(gw, s, plan, now, audit.check if audit is not None else "")
    if not plan.calls_limiter:
        _log_settled(s, plan)
        return
    adjustments = s.adjustments(plan, s.buckets_at(gw.key_prefix, now, cfg.reservation_lease_ms))
    # Called even with nothing to correct: the ledger is marked settled, so it is never
    # reclaimed as abandoned and a replay is a no-op.
    ttl = cfg.ledger_ttl_seconds * 1000
    if gw.background.settle_batcher is not None:
        # many requests' settlements per Redis call, retried until Redis takes them
        gw.background.submit_settlement(
            SettleCall(s.ledger, adjustments, ttl, unconfirmed=s.unconfirmed)
        )
    else:
        await _settle_now(gw, s, adjustments, ttl, plan.delta)
    _count_tokens(gw, s, plan)
    _log_settled(s, plan)


def _audit_input(gw: Gateway, s: Session, audit: InputAudit) -> None:
    """Executes what the request's input figure says of its model's upstream (a model with the
    shortcut, :class:`extproc.core.audits.InputAudits`): billed at the upstream's figure without
    a count (a suspect should a later count disagree), a count that agreed (the shortcut is
    earned or kept), or one that disagreed (the shortcut stops, on every replica)."""
    model = s.model.name if s.model else ""
    if audit.verdict == "uncounted":
        gw.input_audits.billed_uncounted(model, audit.figure, s.report_seq, audit.bound)
    elif audit.verdict == "agreed":
        gw.input_audits.agreed(model, s.report_seq)
    elif audit.disagreed_with is not None:
        _stop_input_shortcut(gw, s, audit.disagreed_with)


def _stop_input_shortcut(gw: Gateway, s: Session, fig: Figure) -> None:
    """A count contradicted the upstream's input figure: that model's later requests on a
    bound are counted, on this replica at once and on the others once they read the stop
    (written to Redis, :meth:`Background.stop_input_shortcut`).  Reported with what it revealed:
    the requests this replica billed at the upstream's figure since the model's last agreeing
    count, and what they were likely short if the upstream under-reported them alike."""
    model = s.model.name if s.model else ""
    suspects = gw.input_audits.disagreed(model)
    if suspects is None:
        return  # stopped already
    estimate = suspects.unbilled_estimate(fig.reported, fig.counted)
    gw.metrics.input_shortcut_stops.labels(model).inc()
    gw.metrics.input_unbilled_estimate.labels(model).inc(estimate)
    gw.background.stop_input_shortcut(
        model,
        {
            "request_id": s.request_id,
            "reported": fig.reported,
            "counted": fig.counted,
            "disagreement": fig.disagreement,
            "suspect_requests": suspects.requests,
            "unbilled_estimate": estimate,
        },
    )
    log.warning(
        "input_shortcut_stopped",
        request_id=s.request_id,
        model=model,
        reported=fig.reported,
        counted=fig.counted,
        disagreement=fig.disagreement,
        gap=fig.counted - fig.reported,
        suspect_requests=suspects.requests,
        suspect_reported_tokens=suspects.reported_tokens,
        unbilled_estimate=estimate,
        config_version=gw.config_version,
        note="this model's input is counted on every replica from now on (this config version)",
    )


async def _settle_now(
    gw: Gateway, s: Session, adjustments: list[Adjustment], ttl: int, delta: int
) -> None:
    """One settlement, one call (a limiter that cannot batch); kept for retry on failure."""
    try:
        if await gw.limiter.settle(
            s.ledger, adjustments, ledger_ttl_ms=ttl, unconfirmed=s.unconfirmed
        ):
            gw.metrics.settlements.labels("applied").inc()
        else:  # our own retried call found it applied (it never applies twice)
            gw.metrics.duplicate_hits.labels("settle").inc()
    except LimiterUnavailable:
        gw.metrics.limiter_errors.labels("settle").inc()
        gw.background.settlements.keep(
            Kept(s.ledger, adjustments, ttl, s.request_id, unconfirmed=s.unconfirmed)
        )
        log.warning("settlement_deferred", request_id=s.request_id, delta=delta)


def _count_tokens(gw: Gateway, s: Session, plan: SettlementPlan) -> None:
    gw.metrics.tokens.labels("net").inc(max(0, plan.total))
    final = plan.usage
    if s.model is not None:
        for kind, n in (
            ("input", final.input),
            ("cached_input", final.cached_input),
            ("output", final.output),
            ("reasoning", final.reasoning),
        ):
            if n:
                gw.metrics.model_tokens.labels(s.model.name, kind).inc(n)


def _record(gw: Gateway, s: Session, plan: SettlementPlan, now_ms: int, check: str = "") -> None:
    """The request's billing record, once, at settlement (never blocks: the recorder queues)."""
    cost, tenant, model = s.cost, s.tenant, s.model
    if gw.recorder is None or cost is None or tenant is None:
        return
    priced = model is not None and model.prices is not None and bool(model.currency)
    bill = plan.billed(cost.requests, model.prices if priced and model is not None else None)
    inp, out, money = bill.input, bill.output, bill.money
    rep = s.reported
    admitted = s.admitted
    gw.recorder.record(
        UsageRecord(
            request_id=s.request_id,
            tenant=tenant.id,
            key=s.key.name if s.key else "",
            model=model.name if model else "",
            api=s.api.name if s.api else "",
            input_tokens=inp,
            output_tokens=out,
            cached_input_tokens=rep.cached_input if rep else 0,
            reasoning_tokens=rep.reasoning if rep else 0,
            cost=money,
            currency=model.currency if money is not None and model else "",
            ending=plan.ending.value,
            status=s.status,
            admitted_at_ms=admitted.at_ms if admitted else 0,
            finished_at_ms=now_ms,
            record_id=record_id_for(s.ledger) if s.ledger else "",
            input_check=check,
            input_reported=rep.input if check and rep is not None else None,
            organisation=tenant.organisation,
            team=tenant.team_of(s.key.name) if s.key else "",
            end_user=s.end_user,
            waited_ms=admitted.waited_ms if admitted else 0,
        )
    )


def _log_settled(s: Session, plan: SettlementPlan) -> None:
    log.info(
        "settled",
        request_id=s.request_id,
        tenant=s.tenant.id if s.tenant else None,
        model=s.model.name if s.model else None,
        ending=plan.ending.value,
        input_tokens=plan.input,
        output_tokens=plan.output,
        charged_total=plan.total,
        correction=plan.delta,
        status=s.status,
    )
