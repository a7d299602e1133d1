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
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol

import structlog

from extproc.core import admission_vocabulary as av
from extproc.core.waiting import HOLD_TIMEOUT_MS
from extproc.errors import LimiterUnavailable
from extproc.gateway import Gateway
from extproc.limiter.base import AdmitCall, AdmitResult
from extproc.limiter.kept import Kept
from extproc.records.model import draft_json
from extproc.server import wire
from extproc.server.context import RequestContext
from extproc.server.counting import count_input
from extproc.server.reclaim import record_reclaimed
from extproc.server.writelock import WriteLock

log = structlog.get_logger("extproc")


class Stream(Protocol):
    """The request's gRPC stream, as a request held for its turn writes to it."""

    writer: Any  # the gRPC context (None: none to write to)
    write_lock: WriteLock


async def admit_body(
    ctx: RequestContext, raw: bytes, started: float, *, stream: Stream
) -> bytes | None:
    """Admit the request (raise a :class:`GatewayError` when not); the body to forward.
    ``stream``: where a request waiting for its turn asks Envoy for the time it needs."""
    s = ctx.s
    return await _execute(
        ctx, s.handle(av.BodyArrived(raw)), started=started, hold=partial(_hold, stream)
    )


async def _hold(stream: Stream) -> None:
    """The request waits for its turn: keep Envoy's message timeout from firing (one override
    per message: the most ``max_message_timeout`` allows)."""
    writer = stream.writer
    if writer is None:
        return
    lock = stream.write_lock
    if not lock.try_acquire():
        await lock.acquire()
    try:
        await writer.write(wire.override_message_timeout(HOLD_TIMEOUT_MS))
    finally:
        lock.release()


async def admit_rpm_only(ctx: RequestContext) -> None:
    """An unmetered path under ``paths.other: rpm_only``: one request on the RPM buckets."""
    started = time.perf_counter()
    s = ctx.s
    await _execute(ctx, s.handle(av.RpmOnlyArrived()), started=started)


async def _execute(
    ctx: RequestContext,
    actions: list[av.AdmissionAction],
    *,
    started: float,
    hold: Callable[[], Awaitable[None]] | None = None,
) -> bytes | None:
    """Execute the admission's actions until it forwards the body (returned), rejects
    (raised) or ends (None)."""
    gw, cfg, s = ctx.gw, ctx.cfg, ctx.s
    held = False  # counted among the replica's waiters
    try:
        while True:
            last: av.AdmissionAction | None = None
            for a in actions:
                note = _NOTES.get(type(a))
                if note is not None:
                    note(ctx, a, started)
                else:
                    last = a  # the one that ends the step: always the last
            if last is None:
                return None
            if type(last) is av.CallAdmit:
                ev: av.AdmissionEvent = await limiter_admit(ctx, last)
            elif type(last) is av.ForwardBody:
                return last.body
            elif type(last) is av.CountExact:
                api, req = s.api, s.req
                assert api is not None and req is not None
                ev = av.InputCounted(
                    await count_input(gw, cfg, api, req, last.model, size=last.size)
                )
            elif type(last) is av.Wait:
                if gw.drains_before(last.until_ms):  # its turn comes after the drain's grace
                    actions = s.handle(av.WaitDeclined("draining"))
                    continue
                if last.first and not held:
                    if gw.waiting >= cfg.max_waiters_per_replica:
                        actions = s.handle(av.WaitDeclined())
                        continue
                    held = True
                    gw.waiting += 1
                    gw.metrics.waiters.inc()
                    _log_wait(ctx, last)
                    if hold is not None:
                        await hold()
                ev = await _sleep_until_turn(ctx, last)
            elif type(last) is av.Reject:
                raise last.error
            else:  # pragma: no cover - every action is handled
                raise TypeError(f"unknown admission action {last!r}")
            actions = s.handle(ev)
    finally:
        if held:
            gw.waiting -= 1
            gw.metrics.waiters.dec()


async def _sleep_until_turn(ctx: RequestContext, w: av.Wait) -> av.AdmissionEvent:
    """Sleep until the request's turn; a client that hangs up meanwhile (the stream is
    cancelled) leaves the queue at once (what admission asks on the cancel).  A drain that
    starts meanwhile and ends before the turn ends the wait at once: the request is asked once
    more without one (docs/operations.md, "Draining")."""
    try:
        gw = ctx.gw
        while True:
            if gw.drains_before(w.until_ms):
                return av.WaitDeclined("draining")
            delay = max(0, w.until_ms - gw.clock.now_ms()) / 1000.0
            if gw.draining or delay == 0:  # a drain that ends after the turn: sleep until it
                await asyncio.sleep(delay)
                return av.TurnCame()
            drain = asyncio.ensure_future(gw.drain_started.wait())
            try:
                done, _ = await asyncio.wait((drain,), timeout=delay)
            finally:
                drain.cancel()
            if not done:
                return av.TurnCame()
    except asyncio.CancelledError:
        _cancelled(ctx)
        raise


def _cancelled(ctx: RequestContext) -> None:
    """The request went away while admission waited: execute what it asks (a cancel to keep,
    a ticket to take out of the queue)."""
    s = ctx.s
    for act in s.handle(av.AdmitCancelled()):
        note = _NOTES.get(type(act))
        assert note is not None  # only notes: a cancel to keep, a queue to leave
        note(ctx, act, 0.0)


async def _leave(gw: Gateway, ticket: str, queue: tuple[str, str, str]) -> None:
    try:
        await gw.limiter.leave_queue(ticket, queue)
    except LimiterUnavailable:
        # the ticket lapses with its lease (a few seconds after its turn)
        log.warning("queue_leave_failed", ticket=ticket)


def _log_wait(ctx: RequestContext, w: av.Wait) -> None:
    s = ctx.s
    log.info(
        "wait",
        request_id=s.request_id,
        tenant=s.tenant.id if s.tenant else None,
        turn_in_ms=max(0, w.until_ms - ctx.gw.clock.now_ms()),
    )


# -- what admission reports: counted, logged, or kept ------------------------------------------


def _attempting(ctx: RequestContext, a: av.Attempting, started: float) -> None:
    structlog.contextvars.bind_contextvars(tenant=a.tenant, model=a.model)


def _input_admission(ctx: RequestContext, a: av.InputAdmission, started: float) -> None:
    ctx.gw.metrics.input_admissions.labels(a.how).inc()


def _limit_decisions(ctx: RequestContext, a: av.LimitDecisions, started: float) -> None:
    for metric, decision in a.decisions:
        ctx.gw.metrics.limit_decisions.labels(metric, decision).inc()


def _keep_leases(ctx: RequestContext, a: av.KeepLeases, started: float) -> None:
    ctx.gw.background.keep_leases()


def _decided(ctx: RequestContext, a: av.Decided, started: float) -> None:
    metrics = ctx.gw.metrics
    metrics.decisions.labels("admitted", "ok").inc()
    metrics.admission_seconds.observe(time.perf_counter() - started)
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


def _shadow_refused(ctx: RequestContext, a: av.ShadowRefused, started: float) -> None:
    log.info(
        "shadow_limit_exceeded",
        request_id=ctx.s.request_id,
        tenant=ctx.s.tenant.id if ctx.s.tenant else None,
        limits=list(a.limits),
        would="refuse",
    )


def _fell_back(ctx: RequestContext, a: av.FellBack, started: float) -> None:
    log.info(
        "fallback",
        request_id=ctx.s.request_id,
        requested=a.requested,
        fallback=a.fallback,
        reason=a.reason,
    )


def _duplicate(ctx: RequestContext, a: av.DuplicateAdmit, started: float) -> None:
    ctx.gw.metrics.duplicate_hits.labels("admit").inc()


def _keep_cancel(ctx: RequestContext, a: av.KeepCancel, started: float) -> None:
    ctx.gw.background.settlements.keep(
        Kept(ctx.s.ledger, a.undo, a.ledger_ttl_ms, ctx.s.request_id, cancel=True)
    )


def _admit_error(ctx: RequestContext, a: av.AdmitError, started: float) -> None:
    ctx.gw.metrics.limiter_errors.labels("admit").inc()
    if a.unmetered:
        log.warning("limiter_unavailable_fail_open", request_id=ctx.s.request_id)


def _pushed_back(ctx: RequestContext, a: av.PushedBack, started: float) -> None:
    ctx.gw.metrics.settlement_pushback.labels("unmetered" if a.unmetered else "refused").inc()
    log.warning("settlement_backlog_full", request_id=ctx.s.request_id, fail_open=a.unmetered)


def _leave_queue(ctx: RequestContext, a: av.LeaveQueue, started: float) -> None:
    """The ticket leaves its queue, in the background (the request is going away, or will
    not wait)."""
    ctx.gw.background.track(asyncio.ensure_future(_leave(ctx.gw, a.ticket, a.queue)))


def _wait_over(ctx: RequestContext, a: av.WaitOver, started: float) -> None:
    metrics = ctx.gw.metrics
    metrics.wait_outcomes.labels(a.outcome).inc()
    if a.outcome in ("admitted", "refused"):
        metrics.wait_seconds.labels(a.outcome).observe(a.waited_ms / 1000.0)
    log.info(
        "wait_over",
        request_id=ctx.s.request_id,
        tenant=ctx.s.tenant.id if ctx.s.tenant else None,
        outcome=a.outcome,
        waited_ms=a.waited_ms,
    )


#: Each reported action's executor, by the action's type (one lookup per action).
_NOTES: dict[type, Callable[[RequestContext, Any, float], None]] = {
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
    av.LeaveQueue: _leave_queue,
    av.WaitOver: _wait_over,
}


async def limiter_admit(ctx: RequestContext, a: av.CallAdmit) -> av.AdmissionEvent:
    """Make the admission call ``a`` and return its answer as the admission's event.
    Settlements waiting for their batch ride on it; requests of dead processors the call
    reclaimed get their usage records here.  A cancelled call keeps the cancel admission asks
    for before the cancellation goes on."""
    gw, s = ctx.gw, ctx.s
    if gw.background.settlements_full():
        return av.AdmitBacklogged()
    # Settlements waiting for their batch ride on this call (applied first, at no extra round
    # trip); whatever happens to the call, they go back to the batcher (applied or not).
    riders = gw.background.riders_for(s.ledger)
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
                queue=a.queue,
            )
        )
        done = res
    except asyncio.CancelledError:
        _cancelled(ctx)
        raise
    except LimiterUnavailable as exc:
        return av.AdmitFailed(exc)
    finally:
        if riders:
            gw.background.riders_done(riders, done)
    gw.room.note(a.charges, res.values)
    if res.reclaimed:
        # Other requests' records: written after this request's answer is on its way, in a
        # context of their own (their log lines do not carry this request's fields).
        asyncio.get_running_loop().call_soon(
            record_reclaimed, gw, ctx.cfg, res.reclaimed, context=contextvars.Context()
        )
    return av.AdmitAnswered(
        res.admitted, res.duplicate, res.values, res.wait, res.turn_ms, res.queue_full
    )
