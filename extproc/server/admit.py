"""Admission, executed: the core's :class:`~extproc.core.admission_flow.Admission` decides, this
module runs what it asks for.

The loop feeds the session the request body (or an ``rpm_only`` path's start), which starts its
admission, executes the actions in order and feeds the session the answer of the last one
(:meth:`extproc.core.session.Session.handle`): the exact input count
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
from collections.abc import Callable
from typing import Any

import structlog

from extproc.config.runtime import RuntimeConfig
from extproc.core import admission_vocabulary as av
from extproc.core.session import Session
from extproc.errors import LimiterUnavailable
from extproc.gateway import Gateway
from extproc.limiter.base import AdmitCall, AdmitResult
from extproc.limiter.kept import Kept
from extproc.records.model import draft_json
from extproc.server.counting import count_input
from extproc.server.reclaim import record_reclaimed

log = structlog.get_logger("extproc")


async def admit_body(
    gw: Gateway, cfg: RuntimeConfig, s: Session, raw: bytes, started: float
) -> bytes | None:
    """Admit the request (raise a :class:`GatewayError` when not); the body to forward."""
    return await _execute(gw, cfg, s, s.handle(av.BodyArrived(raw)), started=started)


async def admit_rpm_only(gw: Gateway, cfg: RuntimeConfig, s: Session) -> None:
    """An unmetered path under ``paths.other: rpm_only``: one request on the RPM buckets."""
    started = time.perf_counter()
    await _execute(gw, cfg, s, s.handle(av.RpmOnlyArrived()), started=started)


async def _execute(
    gw: Gateway,
    cfg: RuntimeConfig,
    s: Session,
    actions: list[av.AdmissionAction],
    *,
    started: float,
) -> bytes | None:
    """Execute the admission's actions until it forwards the body (returned), rejects
    (raised) or ends (None)."""
    while True:
        last: av.AdmissionAction | None = None
        for a in actions:
            note = _NOTES.get(type(a))
            if note is not None:
                note(gw, s, a, started)
            else:
                last = a  # the one that ends the step: always the last
        if last is None:
            return None
        if type(last) is av.CallAdmit:
            ev: av.AdmissionEvent = await limiter_admit(gw, cfg, s, last)
        elif type(last) is av.ForwardBody:
            return last.body
        elif type(last) is av.CountExact:
            api, req = s.api, s.req
            assert api is not None and req is not None
            ev = av.InputCounted(await count_input(gw, cfg, api, req, last.model, size=last.size))
        elif type(last) is av.Reject:
            raise last.error
        else:  # pragma: no cover - every action is handled
            raise TypeError(f"unknown admission action {last!r}")
        actions = s.handle(ev)


# -- what admission reports: counted, logged, or kept ------------------------------------------


def _attempting(gw: Gateway, s: Session, a: av.Attempting, started: float) -> None:
    structlog.contextvars.bind_contextvars(tenant=a.tenant, model=a.model)


def _input_admission(gw: Gateway, s: Session, a: av.InputAdmission, started: float) -> None:
    gw.metrics.input_admissions.labels(a.how).inc()


def _limit_decisions(gw: Gateway, s: Session, a: av.LimitDecisions, started: float) -> None:
    for metric, decision in a.decisions:
        gw.metrics.limit_decisions.labels(metric, decision).inc()


def _keep_leases(gw: Gateway, s: Session, a: av.KeepLeases, started: float) -> None:
    gw.keep_leases()


def _decided(gw: Gateway, s: Session, a: av.Decided, started: float) -> None:
    gw.metrics.decisions.labels("admitted", "ok").inc()
    gw.metrics.admission_seconds.observe(time.perf_counter() - started)
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


def _shadow_refused(gw: Gateway, s: Session, a: av.ShadowRefused, started: float) -> None:
    log.info(
        "shadow_limit_exceeded",
        request_id=s.request_id,
        tenant=s.tenant.id if s.tenant else None,
        limits=list(a.limits),
        would="refuse",
    )


def _fell_back(gw: Gateway, s: Session, a: av.FellBack, started: float) -> None:
    log.info(
        "fallback",
        request_id=s.request_id,
        requested=a.requested,
        fallback=a.fallback,
        reason=a.reason,
    )


def _duplicate(gw: Gateway, s: Session, a: av.DuplicateAdmit, started: float) -> None:
    gw.metrics.duplicate_hits.labels("admit").inc()


def _keep_cancel(gw: Gateway, s: Session, a: av.KeepCancel, started: float) -> None:
    gw.settlements.keep(Kept(s.ledger, a.undo, a.ledger_ttl_ms, s.request_id, cancel=True))


def _admit_error(gw: Gateway, s: Session, a: av.AdmitError, started: float) -> None:
    gw.metrics.limiter_errors.labels("admit").inc()
    if a.unmetered:
        log.warning("limiter_unavailable_fail_open", request_id=s.request_id)


def _pushed_back(gw: Gateway, s: Session, a: av.PushedBack, started: float) -> None:
    gw.metrics.settlement_pushback.labels("unmetered" if a.unmetered else "refused").inc()
    log.warning("settlement_backlog_full", request_id=s.request_id, fail_open=a.unmetered)


#: Each reported action's executor, by the action's type (one lookup per action).
_NOTES: dict[type, Callable[[Gateway, Session, Any, float], None]] = {
    av.Attempting: _attempting,
    av.InputAdmission: _input_admission,
    av.LimitDecisions: _limit_decisions,
    av.KeepLeases: _keep_leases,
    av.Decided: _decided,
    av.ShadowRefused: _shadow_refused,
    av.FellBack: _fell_back,
    av.DuplicateAdmit: _duplicate,
    av.KeepCancel: _keep_cancel,
    av.AdmitError: _admit_error,
    av.PushedBack: _pushed_back,
}


async def limiter_admit(
    gw: Gateway, cfg: RuntimeConfig, s: Session, a: av.CallAdmit
) -> av.AdmissionEvent:
    """Make the admission call ``a`` and return its answer as the admission's event.
    Settlements waiting for their batch ride on it; requests of dead processors the call
    reclaimed get their usage records here.  A cancelled call keeps the cancel admission asks
    for before the cancellation goes on."""
    if gw.settlements_full():
        return av.AdmitBacklogged()
    # Settlements waiting for their batch ride on this call (applied first, at no extra round
    # trip); whatever happens to the call, they go back to the batcher (applied or not).
    riders = gw.riders_for(s.ledger)
    done: AdmitResult | None = None
    d = a.draft
    try:
        res = await gw.limiter.admit(
            AdmitCall(
                s.ledger,
                a.charges,
                tpm_charged=a.tpm_charged,
                count_refused=a.count_refused,
                ledger_ttl_ms=a.ledger_ttl_ms,
                now_ms=a.now_ms,
                lease_until_ms=a.lease_until_ms,
                record_draft=draft_json(d) if d is not None else "",
                settlements=riders,
            )
        )
        done = res
    except asyncio.CancelledError:
        for act in s.handle(av.AdmitCancelled()):
            note = _NOTES.get(type(act))
            assert note is not None  # only a cancel to keep
            note(gw, s, act, 0.0)
        raise
    except LimiterUnavailable as exc:
        return av.AdmitFailed(exc)
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
    return av.AdmitAnswered(res.admitted, res.duplicate, res.values)
