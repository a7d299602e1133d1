"""A metered response stream: the meter, the charge (lazy) or lease (strict) task, the cut.

The driver feeds upstream bytes to the sans-IO :class:`StreamMeter`, forwards what it releases,
starts one charge at a time in the background and applies its answer before the next chunk
(or waits for it when the meter holds events).  When the quota, the backend or the server ends
the stream, it renders the API's own error event and moves the lifecycle to CUT.  The last
response of a stream (its end, or the response carrying the API's terminal event, whichever
comes first) carries the request's final figures as dynamic metadata, so the access log has
them even when the client closes right after ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable, Callable

import structlog

from extproc.config.runtime import RuntimeConfig
from extproc.core import admission
from extproc.core.apis.errors import cut_error, quota_cut
from extproc.core.apis.responses import ResponsesFormat
from extproc.core.encoding import BodyDecoder
from extproc.core.keys import WindowedBucket
from extproc.core.lifecycle import CutReason, Ending, Input
from extproc.core.meter import Step, StreamMeter
from extproc.core.rules import RATE_SCALE, UnconfirmedCharge
from extproc.core.session import Reported, Session, StreamEnd
from extproc.errors import LimiterUnavailable
from extproc.gateway import Gateway
from extproc.limiter.base import ChargeResult
from extproc.server import wire
from extproc.server.settle import access_metadata

log = structlog.get_logger("extproc")

#: Envoy's ``%RESPONSE_CODE_DETAILS%`` for a cut stream.
CUT_DETAILS = "ai_quota_stream_cut"


class StreamDriver:
    """Owns one stream's meter and its pending charge."""

    def __init__(
        self,
        gw: Gateway,
        cfg: RuntimeConfig,
        s: Session,
        decoder: BodyDecoder | None = None,
        *,
        figures_ready: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        cost, req, api, model = s.cost, s.req, s.api, s.model
        assert cost is not None and req is not None and api is not None and model is not None
        self.gw, self.cfg, self.s = gw, cfg, s
        self.decoder = decoder
        # takes the exact input count a figure needs (a large prompt's off the event loop)
        self._figures_ready = figures_ready
        self.reader = api.stream_reader()
        self.meter = StreamMeter(
            count=model.stream_counter(),
            every=cost.every,
            strict=cost.strict,
            enforce=cost.enforce_stream,
            initial_lease=cost.reserved_output,
            strip_usage=cfg.force_include_usage and not req.client_include_usage,
            read=self.reader.read,
            engine_counts=model.continuous_usage and api.name in ("chat", "completions"),
        )
        self._final_sent = False
        self._task: asyncio.Task[ChargeResult] | None = None
        self._charge_buckets: list[WindowedBucket] = []
        self._seq = 0
        self._last: tuple[list[WindowedBucket], tuple[int, ...]] = ([], ())
        self._shadowed: set[str] = set()

    # -- feeding ---------------------------------------------------------------------------

    async def body(self, data: bytes, end: bool) -> list[wire.ProcessingResponse]:
        """Responses for one upstream body chunk."""
        meter = self.meter
        if self.s.life.ended:
            return []
        if self.decoder is not None:
            try:
                data = self.decoder.feed(data) + (self.decoder.flush() if end else b"")
            except zlib.error:
                await self._before_figures()
                return self.cut(
                    CutReason.UNMETERABLE, "The upstream sent a corrupt compressed body."
                )
        out: list[wire.ProcessingResponse] = []
        task = self._task
        if task is not None and task.done():
            # A charge answered since the last chunk: it may release held events, ask for the
            # next charge, or cut the stream. None of that may be dropped.
            answered = self._take_answer()
            if (
                answered.forward
                or answered.charge
                or answered.blocked
                or answered.cut_reason
                or answered.end_stream
            ):
                out += await self._apply(answered)
                if self.s.life.ended:
                    return out
        step = meter.feed(data, end)
        if not (step.charge or step.blocked or step.cut_reason or step.end_stream):
            # The common case: forward what completed, no Redis, no await (the final figures
            # go with the terminal event only: none before the meter saw it; a large prompt's
            # count, when they need it, is awaited then, once).
            if step.forward:
                meta = None
                if meter.complete and not self._final_sent:
                    await self._before_figures()
                    if self.s.life.ended:  # cut meanwhile (shutdown): that cut said it all
                        return out
                    meta = self._terminal_metadata()
                out.append(wire.streamed_body(step.forward, False, meta))
            return out
        out += await self._apply(step)
        return out

    async def trailers(self) -> list[wire.ProcessingResponse]:
        """Upstream trailers: flush what the meter holds before they pass."""
        if self.s.life.ended:
            return []
        step = self.meter.feed(b"", False)
        if not step.forward:
            return []
        if self.complete and not self._final_sent:
            await self._before_figures()
        return [wire.streamed_body(step.forward, False, self._terminal_metadata())]

    async def _before_figures(self) -> None:
        """The stream's figures are about to be decided (its end, a cut): the exact input
        count they need is taken first, off the event loop for a large prompt."""
        if self._figures_ready is not None and self.s.needs_count():
            await self._figures_ready()

    async def _apply(self, step: Step) -> list[wire.ProcessingResponse]:
        """Forward what the meter released, start charges, wait when events are held."""
        meter = self.meter
        out: list[wire.ProcessingResponse] = []
        while True:
            if step.cut_reason is not None or step.end_stream or meter.complete:
                await self._before_figures()
                if self.s.life.ended:  # cut meanwhile (shutdown): that cut has said it all
                    return out
            if step.cut_reason is not None:
                if step.forward:
                    out.append(wire.streamed_body(step.forward, False))
                out += self.cut(step.cut_reason)
                return out
            if step.forward or step.end_stream:
                if step.end_stream:
                    self.s.life.advance(Input.END)
                meta = self.final_metadata() if step.end_stream else self._terminal_metadata()
                out.append(wire.streamed_body(step.forward, step.end_stream, meta))
            if step.charge:
                self._start_charge(step.charge)
            if not step.blocked:
                return out
            answered = await self.collect(wait=True)
            if answered is None:  # nothing in flight: cannot happen, but never stall a stream
                log.error("blocked_without_charge", request_id=self.s.request_id)
                answered = meter.stop_enforcing()
            step = answered

    @property
    def complete(self) -> bool:
        """The API's terminal event reached the client (the stream completed)."""
        return self.meter.complete and self.meter.cut_reason is None

    def end(self) -> StreamEnd:
        """What the meter knows for settlement; the upstream's usage goes to the session."""
        m = self.meter
        if m.usage is not None:
            self.s.report(Reported.of(m.usage))
        return StreamEnd(
            counted=m.counted,
            delivered=m.delivered,
            complete=m.complete or (m.upstream_done and m.cut_reason is None),
            cut=m.cut_reason is not None,
            text_events=m.text_events,
        )

    def final_metadata(self) -> dict[str, object]:
        """Dynamic metadata for the stream's last response: the final figures (decided once,
        the same ones settlement charges)."""
        self._final_sent = True
        got = self.s.stream_output(self.end())
        out = got if isinstance(got, int) else got.value
        if self.complete:
            self.s.life.name_ending(Ending.COMPLETED)
        return access_metadata(self.s, output_tokens=out)

    def _terminal_metadata(self) -> dict[str, object] | None:
        """The final figures on the response carrying the terminal event (once): a client that
        closes right after ``[DONE]`` leaves no later response to carry them."""
        if self._final_sent or not self.complete:
            return None
        return self.final_metadata()

    # -- charges ---------------------------------------------------------------------------

    def _start_charge(self, amount: int) -> None:
        s, gw = self.s, self.gw
        # TPM buckets only, in the order the limiter returns their values.
        now = gw.clock.now_ms()
        self._charge_buckets = [
            b
            for b in s.buckets_at(gw.key_prefix, now, self.cfg.reservation_lease_ms)
            if b.kind == "tpm"
        ]
        self._seq += 1
        gw.metrics.stream_charges.labels("strict" if self.meter.strict else "lazy").inc()
        self._task = asyncio.ensure_future(
            gw.limiter.charge(
                s.ledger,
                self._seq,
                admission.token_charges(self._charge_buckets, amount),
                amount,
                strict=self.meter.strict,
                ledger_ttl_ms=self.cfg.ledger_ttl_seconds * 1000,
            )
        )

    @property
    def charge_pending(self) -> bool:
        """A charge was started and its answer not yet applied."""
        return self._task is not None

    def charge_unconfirmed(self) -> None:
        """Settlement will not wait any longer for the pending charge's answer: it is marked
        unconfirmed (by its sequence number), so whichever runs first in Redis, it is counted
        once: run before the settlement, the settlement takes back what it added (its
        figures are computed without it); run after, it finds the ledger settled and charges
        nothing."""
        if self._task is not None and self._seq > 0:
            self.s.unconfirmed = UnconfirmedCharge(
                self._seq, tuple((b.key, b.rates.output) for b in self._charge_buckets)
            )

    async def collect(self, *, wait: bool) -> Step | None:
        """Apply a finished (or, with ``wait``, the pending) charge's answer to the meter."""
        task = self._task
        if task is None or (not wait and not task.done()):
            return None
        if not task.done():
            await asyncio.wait([task])
        return self._take_answer()

    def _take_answer(self) -> Step:
        task = self._task
        assert task is not None and task.done()
        self._task = None
        meter = self.meter
        try:
            res = task.result()
        except LimiterUnavailable as exc:
            self.gw.metrics.limiter_errors.labels("charge").inc()
            if exc.maybe_ran:  # it may still run once Redis answers: settlement takes it back
                self.s.unconfirmed = UnconfirmedCharge(
                    self._seq, tuple((b.key, b.rates.output) for b in self._charge_buckets)
                )
            meter.on_charge_failed()
            if self.cfg.failure_mode_for(self.s.plan) == "open":
                log.warning("limiter_unavailable_stream_unmetered", request_id=self.s.request_id)
                return meter.stop_enforcing()
            return meter.fail(CutReason.BACKEND_UNAVAILABLE)
        self.s.account.record_output(self._charge_buckets, res.granted)
        self._last = (self._charge_buckets, res.values)
        self._note_shadow(res.values)
        room = min(
            (
                (b.limit.limit - v) * RATE_SCALE // b.rates.output
                for b, v in zip(self._charge_buckets, res.values, strict=True)
                if not b.limit.shadow and b.rates.output > 0
            ),
            default=None,
        )
        return meter.on_charge(res.granted, res.exhausted, room)

    def _note_shadow(self, values: tuple[int, ...]) -> None:
        """A shadow limit this stream took past its limit: counted and logged once, never cut."""
        for b, v in zip(self._charge_buckets, values, strict=True):
            if b.limit.shadow and v > b.limit.limit and b.key not in self._shadowed:
                self._shadowed.add(b.key)
                self.gw.metrics.limit_decisions.labels(b.metric, "shadow_cut").inc()
                log.info(
                    "shadow_limit_exceeded",
                    request_id=self.s.request_id,
                    tenant=self.s.tenant.id if self.s.tenant else None,
                    limit=admission.describe(b.limit),
                    used=v,
                    would="cut",
                )

    # -- cutting ---------------------------------------------------------------------------

    def cut(self, reason: CutReason, message: str | None = None) -> list[wire.ProcessingResponse]:
        """End the stream now with the API's error event for ``reason``."""
        s, meter = self.s, self.meter
        api = s.api
        assert api is not None
        if s.life.ended:
            return []
        s.life.cut(reason)
        budget = False
        if reason is CutReason.QUOTA_EXHAUSTED:
            assert s.tenant is not None
            buckets, values = self._last
            # what each counter will hold once settlement charges what was delivered
            message, budget = quota_cut(
                tenant=s.tenant.id,
                charged=[
                    (b, v + s.pending_units(b, meter.delivered))
                    for b, v in zip(buckets, values, strict=True)
                ],
                admitted=list(s.buckets),
                delivered=meter.delivered,
                now_ms=self.gw.clock.now_ms(),
            )
        err = cut_error(reason.value, message, budget=budget)
        if isinstance(api, ResponsesFormat):  # its events are numbered: continue the count
            seq = getattr(self.reader, "last_sequence_number", None)
            data = meter.cut(api.cut_events(err, sequence_number=seq))
        else:
            data = meter.cut(api.cut_events(err))
        self.gw.metrics.stream_cuts.labels(reason.value).inc()
        log.info(
            "stream_cut",
            tenant=s.tenant.id if s.tenant else None,
            reason=reason.value,
            delivered_tokens=meter.delivered,
            charged=s.account.total,
        )
        # The error event, then an immediate response: the response has started, so Envoy
        # resets it (HTTP/1.1: the connection closes before the last chunk; HTTP/2: RST_STREAM)
        # after delivering the event.  Clients that look at nothing but the transport
        # (inference-perf) see the cut as a failed request, not a short success.
        return [
            wire.streamed_body(data, False, self.final_metadata()),
            wire.immediate(err.status, [], b"", CUT_DETAILS),
        ]
