"""Admission, executed: the core's :class:`~extproc.core.admitting.Admission` decides, this
module runs what it asks for.

The loop starts the admission on the request body (or on an ``rpm_only`` path), executes its
actions in order and feeds it the answer of the last one: the exact input count
(:mod:`extproc.server.counting`, a large prompt in a worker thread) or the admission call's
answer.  The call itself (:func:`limiter_admit`) carries the settlements waiting for their
batch, notes the counters' values for the next bound, and hands the records of dead
processors' requests it reclaimed to their writer.  A rejection is raised as the
:class:`GatewayError` it is (the processor renders it, at its one error boundary).
"""

from __future__ import annotations

import asyncio
import contextvars
import time

import structlog

from extproc.config.runtime import RuntimeConfig
from extproc.core.actions import (
    AdmissionAction,
    AdmitError,
    Attempting,
    CallAdmit,
    CountExact,
    Decided,
    DuplicateAdmit,
    FellBack,
    ForwardBody,
    InputAdmission,
    KeepCancel,
    KeepLeases,
    LimitDecisions,
    PushedBack,
    Reject,
    ShadowRefused,
)
from extproc.core.admitting import Admission
from extproc.core.events import (
    AdmissionEvent,
    AdmitAnswered,
    AdmitBacklogged,
    AdmitCancelled,
    AdmitFailed,
    InputCounted,
)
from extproc.core.session import Session
from extproc.errors import LimiterUnavailable
from extproc.gateway import Gateway
from extproc.limiter.base import AdmitResult
from extproc.limiter.kept import Kept
from extproc.records.model import RecordDraft
from extproc.server.counting import count_input
from extproc.server.reclaim import record_reclaimed

log = structlog.get_logger("extproc")


def _admission(gw: Gateway, cfg: RuntimeConfig, s: Session) -> Admission:
    return Admission(
        s,
        cfg,
        key_prefix=gw.key_prefix,
        room=gw.room,
        records=gw.recorder is not None,
        now_ms=gw.clock.now_ms,
    )


async def admit_body(
    gw: Gateway, cfg: RuntimeConfig, s: Session, raw: bytes, started: float
) -> bytes | None:
    """Admit the request (raise a :class:`GatewayError` when not); the body to forward."""
    adm = _admission(gw, cfg, s)
    return await _execute(gw, cfg, s, adm, adm.body(raw), started=started)


async def admit_rpm_only(gw: Gateway, cfg: RuntimeConfig, s: Session) -> None:
    """An unmetered path under ``paths.other: rpm_only``: one request on the RPM buckets."""
    adm = _admission(gw, cfg, s)
    await _execute(gw, cfg, s, adm, adm.rpm_only(), started=time.perf_counter())


async def _execute(
    gw: Gateway,
    cfg: RuntimeConfig,
    s: Session,
    adm: Admission,
    actions: list[AdmissionAction],
    *,
    started: float,
) -> bytes | None:
    """Execute the admission's actions until it forwards the body (returned), rejects
    (raised) or ends (None)."""
    while True:
        ev: AdmissionEvent | None = None
        for a in actions:
            if type(a) is CallAdmit:
                ev = await limiter_admit(gw, cfg, s, adm, a)
            elif type(a) is ForwardBody:
                return a.body
            elif type(a) is CountExact:
                api, req = s.api, s.req
                assert api is not None and req is not None
                ev = InputCounted(await count_input(gw, cfg, api, req, a.model, size=a.size))
            elif type(a) is Reject:
                raise a.error
            else:
                _note(gw, s, a, started)
        if ev is None:
            return None
        actions = adm.handle(ev)


def _note(gw: Gateway, s: Session, a: AdmissionAction, started: float) -> None:
    """Count and log what admission reported (or keep what it asked to keep)."""
    m = gw.metrics
    # checked by identity (cheaper than isinstance; mypy narrows it), the common ones first
    if type(a) is Attempting:
        structlog.contextvars.bind_contextvars(tenant=a.tenant, model=a.model)
    elif type(a) is InputAdmission:
        m.input_admissions.labels(a.how).inc()
    elif type(a) is LimitDecisions:
        for metric, decision in a.decisions:
            m.limit_decisions.labels(metric, decision).inc()
    elif type(a) is KeepLeases:
        gw.keep_leases()
    elif type(a) is Decided:
        m.decisions.labels("admitted", "ok").inc()
        m.admission_seconds.observe(time.perf_counter() - started)
        log.info(
            "decision",
            tenant=a.tenant,
            key=a.key,
            model=a.model,
            api=a.api,
            input_tokens=a.input_tokens,
            input_counted=a.input_counted,
            reserved_output=a.reserved_output,
            stream=a.stream,
            decision=a.decision,
            mode=a.mode,
            streaming=a.streaming,
            latency_ms=round((time.perf_counter() - started) * 1000, 3),
        )
    elif type(a) is ShadowRefused:
        log.info(
            "shadow_limit_exceeded",
            request_id=s.request_id,
            tenant=s.tenant.id if s.tenant else None,
            limits=list(a.limits),
            would="refuse",
        )
    elif type(a) is FellBack:
        log.info(
            "fallback",
            request_id=s.request_id,
            requested=a.requested,
            fallback=a.fallback,
            reason=a.reason,
        )
    elif type(a) is DuplicateAdmit:
        m.duplicate_hits.labels("admit").inc()
    elif type(a) is KeepCancel:
        gw.settlements.keep(Kept(s.ledger, a.undo, a.ledger_ttl_ms, s.request_id, cancel=True))
    elif type(a) is AdmitError:
        m.limiter_errors.labels("admit").inc()
        if a.unmetered:
            log.warning("limiter_unavailable_fail_open", request_id=s.request_id)
    elif type(a) is PushedBack:
        m.settlement_pushback.labels("unmetered" if a.unmetered else "refused").inc()
        log.warning("settlement_backlog_full", request_id=s.request_id, fail_open=a.unmetered)
    else:  # pragma: no cover - every action is handled above
        raise TypeError(f"unknown admission action {a!r}")


async def limiter_admit(
    gw: Gateway, cfg: RuntimeConfig, s: Session, adm: Admission, a: CallAdmit
) -> AdmissionEvent:
    """Make the admission call ``a`` and return its answer as the admission's event.
    Settlements waiting for their batch ride on it; requests of dead processors the call
    reclaimed get their usage records here.  A cancelled call keeps the cancel admission asks
    for before the cancellation goes on."""
    if gw.settlements_full():
        return AdmitBacklogged()
    # Settlements waiting for their batch ride on this call (applied first, at no extra round
    # trip); whatever happens to the call, they go back to the batcher (applied or not).
    riders = gw.riders_for(s.ledger)
    done: AdmitResult | None = None
    d = a.draft
    try:
        res = await gw.limiter.admit(
            s.ledger,
            a.charges,
            tpm_charged=a.tpm_charged,
            count_refused=a.count_refused,
            ledger_ttl_ms=a.ledger_ttl_ms,
            now_ms=a.now_ms,
            lease_until_ms=a.lease_until_ms,
            record_draft=(
                RecordDraft(
                    request_id=d.request_id,
                    tenant=d.tenant,
                    key=d.key,
                    model=d.model,
                    api=d.api,
                    input_tokens=d.input_tokens,
                    reserved_output=d.reserved_output,
                    admitted_at_ms=d.admitted_at_ms,
                ).to_json()
                if d is not None
                else ""
            ),
            settlements=riders,
        )
        done = res
    except asyncio.CancelledError:
        for act in adm.handle(AdmitCancelled()):
            _note(gw, s, act, 0.0)
        raise
    except LimiterUnavailable as exc:
        return AdmitFailed(exc)
    finally:
        if riders:
            gw.riders_done(riders, done)
    gw.room.note(a.charges, res.values)
    if res.reclaimed:
        # Other requests' records: written after this request's answer is on its way, in a
        # context of their own (their log lines do not carry this request's fields).
        asyncio.get_running_loop().call_soon(
            record_reclaimed, gw, cfg, res.reclaimed, context=contextvars.Context()
        )
    return AdmitAnswered(res.admitted, res.duplicate, res.values)
