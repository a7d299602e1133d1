"""A metered response stream, executed: events fed to the core's stream, its actions run.

The driver feeds each upstream body chunk (with the answer of a charge that finished since the
chunk before) to the session, whose metered stream (:class:`extproc.core.streaming.MeteredStream`)
takes it, and executes what it returns:
forward bytes, start one charge at a time in the background, wait for it when events are
held, take the exact input count off the event loop when a figure needs it, render a cut as
the API's error event then an aborted response, count and log.  It decides nothing itself.
The last response of a stream (its end, or the response carrying the API's terminal event,
whichever comes first) carries the request's final figures as dynamic metadata, so the access
log has them even when the client closes right after ``[DONE]``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from extproc.core import stream_vocabulary as sv
from extproc.core.lifecycle import CutReason
from extproc.core.meter import StreamMeter
from extproc.core.phase_records import StreamEnd
from extproc.core.streaming import CHARGE_WAIT_SECONDS, MeteredStream
from extproc.errors import LimiterUnavailable
from extproc.limiter.base import ChargeResult
from extproc.server import wire
from extproc.server.context import RequestContext
from extproc.server.settle import access_metadata
from extproc.telemetry.base import NOOP_TRACE, RequestTrace

log = structlog.get_logger("extproc")

#: Envoy's ``%RESPONSE_CODE_DETAILS%`` for a cut stream.
CUT_DETAILS = "ai_quota_stream_cut"

_streamed_body = wire.streamed_body


class StreamDriver:
    """Owns one stream's I/O: its pending charge task; the stream itself is the core's."""

    def __init__(
        self,
        ctx: RequestContext,
        *,
        figures_ready: Callable[[], Awaitable[None]] | None = None,
        trace: RequestTrace = NOOP_TRACE,
    ) -> None:
        self.gw, self.cfg, self.s = ctx.gw, ctx.cfg, ctx.s
        self.trace = trace
        stream = ctx.s.stream  # started by the session with the response's headers
        assert isinstance(stream, MeteredStream)
        #: the session's metered stream (read here: fed only through the session)
        self.stream = stream
        # takes the exact input count a figure needs (a large prompt's off the event loop)
        self._figures_ready = figures_ready
        self._task: asyncio.Task[ChargeResult] | None = None
        #: the response is over (read after :meth:`body`: a chunk that only forwards leaves
        #: it as it was)
        self.ended = False

    @property
    def meter(self) -> StreamMeter:
        """The stream's meter (read-only use: tests and logs)."""
        return self.stream.meter

    # -- feeding ---------------------------------------------------------------------------

    async def body(self, data: bytes, end: bool) -> list[wire.ProcessingResponse]:
        """Responses for one upstream body chunk."""
        task = self._task
        answer = self._answer() if task is not None and task.done() else None
        actions = self.s.handle(sv.BodyChunk(data, end, answer))
        if len(actions) == 1:
            a = actions[0]
            # the common case: forward, no Redis, no await (and the stream goes on)
            if type(a) is sv.Forward and not a.end_stream:  # checked by identity (mypy narrows it)
                out = a.output_tokens
                meta = None if out is None else self._metadata(out)
                return [_streamed_body(a.data, False, meta)]
        out_ = await self._run(actions) if actions else []
        self.ended = self.stream.ended
        return out_

    async def trailers(self) -> list[wire.ProcessingResponse]:
        """Upstream trailers: flush what the meter holds before they pass."""
        return await self._run(self.s.handle(sv.Trailers()))

    @property
    def complete(self) -> bool:
        """The API's terminal event reached the client (the stream completed)."""
        return self.stream.complete

    def end(self) -> StreamEnd:
        """What the meter knows for settlement."""
        return self.stream.end()

    def cut(self, reason: CutReason) -> list[wire.ProcessingResponse]:
        """End the stream now with the API's error event for ``reason`` (the input count is
        taken: the caller awaited it)."""
        out: list[wire.ProcessingResponse] = []
        for a in self.s.handle(sv.CutNow(reason)):
            assert isinstance(a, sv.Cut)
            out += self._render_cut(a)
        self.ended = self.stream.ended
        return out

    # -- executing -------------------------------------------------------------------------

    async def _run(self, actions: list[sv.StreamAction]) -> list[wire.ProcessingResponse]:
        """Execute ``actions`` in order; a wait's answer feeds the stream and its actions
        follow."""
        out: list[wire.ProcessingResponse] = []
        todo = actions
        i = 0
        while i < len(todo):
            a = todo[i]
            i += 1
            if isinstance(a, sv.Forward):
                meta = None if a.output_tokens is None else self._metadata(a.output_tokens)
                out.append(_streamed_body(a.data, a.end_stream, meta))
            elif isinstance(a, sv.StartCharge):
                self._start_charge(a)
            elif isinstance(a, sv.AwaitCharge):
                todo = todo[i:] + self.s.handle(await self._wait_answer())
                i = 0
            elif isinstance(a, sv.CountInput):
                if self._figures_ready is not None:
                    await self._figures_ready()
                todo = todo[i:] + self.s.handle(sv.CountDone())
                i = 0
            elif isinstance(a, sv.Cut):
                out += self._render_cut(a)
            else:
                self._note(a)
        return out

    def _note(self, a: sv.StreamAction) -> None:
        """Count and log what the stream reported."""
        s = self.s
        if isinstance(a, sv.ChargeError):
            self.gw.metrics.limiter_errors.labels("charge").inc()
            if a.unmetered:
                self.trace.mark("stream_unmetered")
                log.warning("limiter_unavailable_stream_unmetered", request_id=s.request_id)
        elif isinstance(a, sv.ShadowExceeded):
            self.gw.metrics.limit_decisions.labels(a.metric, "shadow_cut").inc()
            log.info(
                "shadow_limit_exceeded",
                request_id=s.request_id,
                tenant=s.tenant.id if s.tenant else None,
                limit=a.limit,
                used=a.used,
                would="cut",
            )
        elif isinstance(a, sv.StalledWithoutCharge):
            log.error("blocked_without_charge", request_id=s.request_id)

    def _metadata(self, output_tokens: int) -> dict[str, object]:
        return access_metadata(self.s, output_tokens=output_tokens)

    def _render_cut(self, a: sv.Cut) -> list[wire.ProcessingResponse]:
        s = self.s
        self.trace.cut(a)
        self.gw.metrics.stream_cuts.labels(a.reason.value).inc()
        log.info(
            "stream_cut",
            tenant=s.tenant.id if s.tenant else None,
            reason=a.reason.value,
            delivered_tokens=a.delivered,
            charged=a.charged,
        )
        # The error event, then an immediate response: the response has started, so Envoy
        # resets it (HTTP/1.1: the connection closes before the last chunk; HTTP/2: RST_STREAM)
        # after delivering the event.  Clients that look at nothing but the transport
        # (inference-perf) see the cut as a failed request, not a short success.
        return [
            wire.streamed_body(a.data, False, self._metadata(a.output_tokens)),
            wire.immediate(a.error.status, [], b"", CUT_DETAILS),
        ]

    # -- charges ---------------------------------------------------------------------------

    def _start_charge(self, a: sv.StartCharge) -> None:
        self.gw.metrics.stream_charges.labels("strict" if a.strict else "lazy").inc()
        self.trace.charge(a.seq, a.amount, strict=a.strict)
        self._task = asyncio.ensure_future(
            self.gw.limiter.charge(
                self.s.ledger,
                a.seq,
                a.charges,
                a.amount,
                strict=a.strict,
                ledger_ttl_ms=self.cfg.ledger_ttl_seconds * 1000,
            )
        )

    def _answer(self, *, late: bool = False) -> sv.ChargeAnswered | sv.ChargeFailed:
        """The finished charge task's answer, as the stream's event."""
        task = self._task
        assert task is not None and task.done()
        self._task = None
        try:
            res = task.result()
        except LimiterUnavailable as exc:
            self.trace.charge_answered(None)
            return sv.ChargeFailed(exc.maybe_ran, late=late)
        self.trace.charge_answered(res.granted, exhausted=res.exhausted)
        return sv.ChargeAnswered(res.granted, res.exhausted, res.values, late=late)

    async def _wait_answer(self) -> sv.StreamEvent:
        task = self._task
        assert task is not None
        if not task.done():
            await asyncio.wait([task])
        return self._answer()

    async def _collect_late(self) -> None:
        task = self._task
        if task is None:
            return
        if not task.done():
            await asyncio.wait([task])
        if self._task is task:
            for a in self.s.handle(self._answer(late=True)):
                self._note(a)

    async def settle_charge(self) -> None:
        """Settlement is about to run: wait a while (:data:`CHARGE_WAIT_SECONDS`) for the
        charge in flight; one not answered by then is settled as unconfirmed (counted once,
        whether it ran or not)."""
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._collect_late()), CHARGE_WAIT_SECONDS)
        except Exception as exc:  # settlement must still run
            log.warning("pending_charge_lost", request_id=self.s.request_id, error=repr(exc))
        if self._task is not None:
            self.s.handle(sv.ChargeAbandoned())
