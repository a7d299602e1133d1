"""A metered response stream, driven by events: the session's stream part, sans-IO.

The server feeds :class:`MeteredStream` the events it sees (:mod:`extproc.core.events`: a body
chunk with the limiter's answer that came before it, trailers, an awaited charge's answer, the
input count done, a shutdown cut) and executes the actions it returns
(:mod:`extproc.core.actions`), in order.  Every decision is taken here: what passes, when to
charge and on which buckets, what a charge's answer means (the room it leaves, a shadow limit
crossed, fail-open or a cut when the limiter fails), the cut's message, the final figures and
the request's lifecycle moves (its end, its cut).  The server owns only the I/O: the charge
task, the wait for it, the count off the event loop, the bytes to Envoy, metrics and logs.

A step that needs something the server must await (the exact input count before a figure, the
answer of the charge that holds events) returns the request for it as its last action and
resumes when the matching event (:class:`~extproc.core.events.CountDone`, the answer) arrives.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from extproc.core import admission_plan
from extproc.core.actions import (
    AwaitCharge,
    ChargeError,
    CountInput,
    Cut,
    Forward,
    ShadowExceeded,
    StalledWithoutCharge,
    StartCharge,
    StreamAction,
)
from extproc.core.apis.errors import cut_error, quota_cut
from extproc.core.apis.responses import ResponsesFormat
from extproc.core.encoding import BodyDecoder
from extproc.core.events import (
    BodyChunk,
    ChargeAbandoned,
    ChargeAnswered,
    ChargeFailed,
    CountDone,
    CutNow,
    StreamEvent,
    Trailers,
)
from extproc.core.keys import WindowedBucket
from extproc.core.lifecycle import CutReason, Ending, Input
from extproc.core.meter import Step, StreamMeter
from extproc.core.phase_records import Reported, StreamEnd
from extproc.core.rules import RATE_SCALE, UnconfirmedCharge
from extproc.core.session import Session

#: How long settlement waits for the answer of a charge still in flight before it settles
#: without it (the charge is then marked unconfirmed: counted once whichever runs first).
CHARGE_WAIT_SECONDS: Final = 1.0


# -- the stream's wait states: what follows once the server answers (data, not closures) -----


@dataclass(frozen=True, slots=True)
class FeedNext:
    """Then meter this chunk (it came with a charge's answer), unless the stream ended."""

    data: bytes
    end: bool


#: What follows a step once it may go on: nothing more, or the chunk still to meter.
Then = FeedNext | None


@dataclass(frozen=True, slots=True)
class ApplyStep:
    """Apply the meter's ``step`` (unless the stream ended meanwhile), then ``then``."""

    step: Step
    then: Then


@dataclass(frozen=True, slots=True)
class ForwardTerminal:
    """Forward the terminal event with the final figures (``unless_ended``: not when the stream
    was cut meanwhile: that cut said it all)."""

    data: bytes
    unless_ended: bool


@dataclass(frozen=True, slots=True)
class CutCorrupt:
    """Cut the stream for a corrupt compressed body; ``late``: the side actions of a charge's
    answer that came with it."""

    late: tuple[StreamAction, ...]


#: What resumes once the exact input count is taken.
Resume = ApplyStep | ForwardTerminal | CutCorrupt


@dataclass(frozen=True, slots=True)
class AwaitingCount:
    """Waiting for the exact input count (:class:`~extproc.core.events.CountDone`) the final
    figures need; then ``resume``."""

    resume: Resume


@dataclass(frozen=True, slots=True)
class AwaitingCharge:
    """Events are held until the charge in flight answers; then apply its step and ``then``."""

    then: Then


def room_after(buckets: Iterable[WindowedBucket], values: Iterable[int]) -> int | None:
    """Output tokens the tightest enforced bucket still has after a charge left it at
    ``values`` (None when no enforced bucket prices output)."""
    return min(
        (
            (b.limit.limit - v) * RATE_SCALE // b.rates.output
            for b, v in zip(buckets, values, strict=True)
            if not b.limit.shadow and b.rates.output > 0
        ),
        default=None,
    )


def unconfirmed_charge(seq: int, buckets: Iterable[WindowedBucket]) -> UnconfirmedCharge:
    """The record settlement needs to take back charge ``seq`` if it ran unanswered."""
    return UnconfirmedCharge(seq, tuple((b.key, b.rates.output) for b in buckets))


class MeteredStream:
    """One metered response stream: its meter, its charges, its cut and its final figures."""

    __slots__ = (
        "_awaiting_charge",
        "_awaiting_count",
        "_charge_buckets",
        "_decoder",
        "_fail_open",
        "_final_sent",
        "_in_flight",
        "_last",
        "_lease_ms",
        "_now_ms",
        "_prefix",
        "_seq",
        "_shadowed",
        "meter",
        "reader",
        "s",
    )

    def __init__(
        self,
        s: Session,
        decoder: BodyDecoder | None = None,
        *,
        force_include_usage: bool,
        key_prefix: str,
        lease_ms: int,
        fail_open: bool,
        now_ms: Callable[[], int],
    ) -> None:
        cost, req, api, model = s.cost, s.req, s.api, s.model
        assert cost is not None and req is not None and api is not None and model is not None
        self.s = s
        self._decoder = decoder
        self._prefix = key_prefix
        self._lease_ms = lease_ms
        self._fail_open = fail_open
        self._now_ms = now_ms
        self.reader = api.stream_reader()
        self.meter = StreamMeter(
            count=model.stream_counter(),
            every=cost.every,
            strict=cost.strict,
            enforce=cost.enforce_stream,
            initial_lease=cost.reserved_output,
            strip_usage=force_include_usage and not req.client_include_usage,
            read=self.reader.read,
            engine_counts=model.continuous_usage and api.name in ("chat", "completions"),
        )
        self._final_sent = False
        self._in_flight = False  # a charge was asked for and its answer not yet reported
        self._seq = 0
        self._charge_buckets: tuple[WindowedBucket, ...] = ()
        self._last: tuple[tuple[WindowedBucket, ...], tuple[int, ...]] = ((), ())
        self._shadowed: set[str] = set()
        # the wait states (None: not waiting): the count's and the charge's
        self._awaiting_count: AwaitingCount | None = None
        self._awaiting_charge: AwaitingCharge | None = None

    # -- what the server reads -------------------------------------------------------------

    @property
    def ended(self) -> bool:
        """The response is over (completed, cut or answered by the gateway)."""
        return self.s.life.ended

    @property
    def complete(self) -> bool:
        """The API's terminal event reached the client (the stream completed)."""
        return self.meter.complete and self.meter.cut_reason is None

    @property
    def strict(self) -> bool:
        """Charges are leases (granted only as far as the quota goes)."""
        return self.meter.strict

    @property
    def waiting(self) -> AwaitingCount | AwaitingCharge | None:
        """The wait state the stream is in (None: none): for the count, or for the charge."""
        return self._awaiting_count or self._awaiting_charge

    def end(self) -> StreamEnd:
        """What the meter knows for settlement; the upstream's usage goes to the session."""
        m = self.meter
        usage = m.stats.usage
        if usage is not None:
            self.s.report(Reported.of(usage))
        return StreamEnd(
            counted=m.counted,
            delivered=m.delivered,
            complete=m.complete or (m.upstream_done and m.cut_reason is None),
            cut=m.cut_reason is not None,
            text_events=m.stats.text_events,
        )

    # -- events ----------------------------------------------------------------------------

    def handle(self, ev: StreamEvent) -> list[StreamAction]:
        """Take one event; return what the server must do, in order."""
        t = type(ev)
        if t is BodyChunk:
            assert isinstance(ev, BodyChunk)
            return self.chunk(ev.data, ev.end, ev.answer)
        if t is ChargeAnswered or t is ChargeFailed:
            assert isinstance(ev, ChargeAnswered | ChargeFailed)
            side, step = self._take(ev)
            if ev.late:
                return side
            waiting, self._awaiting_charge = self._awaiting_charge, None
            return side + self._apply(step, waiting.then if waiting is not None else None)
        if t is CountDone:
            counting, self._awaiting_count = self._awaiting_count, None
            return self._resume(counting.resume) if counting is not None else []
        if t is Trailers:
            return self._trailers()
        if t is CutNow:
            assert isinstance(ev, CutNow)
            return self._cut(ev.reason, ev.message)
        if t is ChargeAbandoned:
            if self._in_flight and self._seq > 0:
                self.s.unconfirmed = unconfirmed_charge(self._seq, self._charge_buckets)
            return []
        raise TypeError(f"not a stream event: {ev!r}")  # pragma: no cover - typed

    def chunk(
        self, data: bytes, end: bool, answer: ChargeAnswered | ChargeFailed | None = None
    ) -> list[StreamAction]:
        """``handle(BodyChunk(data, end, answer))`` without building the event: the per-chunk
        call (as h2's ``receive_data``).  The chunk is the request's response body event too:
        the session's lifecycle takes it first."""
        life = self.s.life
        life.advance(Input.RESPONSE_BODY)
        if answer is None and self._decoder is None:
            if life.ended:
                return []
            meter = self.meter
            step = meter.feed(data, end)
            if (
                step.charge == 0
                and not (step.blocked or step.cut_reason or step.end_stream)
                and (not meter.complete or self._final_sent)
            ):
                # The common case: forward what completed, no charge, no wait.
                return [Forward(step.forward)] if step.forward else []
            return self._stepped(step)
        return self._chunk(data, end, answer)

    def _chunk(
        self, data: bytes, end: bool, answer: ChargeAnswered | ChargeFailed | None
    ) -> list[StreamAction]:
        if self.s.life.ended:
            # the answer still counts (its units are in Redis): bookkeeping only
            return self._take(answer)[0] if answer is not None else []
        if self._decoder is not None:
            try:
                data = self._decoder.feed(data) + (self._decoder.flush() if end else b"")
            except zlib.error:
                late = self._take(answer)[0] if answer is not None else []
                return self._after_count(CutCorrupt(tuple(late)))
        if answer is not None:
            # A charge answered since the last chunk: it may release held events, ask for the
            # next charge, or cut the stream. None of that may be dropped.
            side, answered = self._take(answer)
            if (
                answered.forward
                or answered.charge
                or answered.blocked
                or answered.cut_reason
                or answered.end_stream
            ):
                return side + self._apply(answered, FeedNext(data, end))
            return side + self._feed(data, end)
        return self._feed(data, end)

    def _feed(self, data: bytes, end: bool) -> list[StreamAction]:
        return self._stepped(self.meter.feed(data, end))

    def _stepped(self, step: Step) -> list[StreamAction]:
        """What follows the meter's ``step`` for a body chunk."""
        meter = self.meter
        if step.charge == 0 and not (step.blocked or step.cut_reason or step.end_stream):
            # The common case: forward what completed, no charge, no wait (the final figures
            # go with the terminal event only: none before the meter saw it; a large prompt's
            # count, when they need it, is asked for then, once).
            if step.forward:
                if meter.complete and not self._final_sent:
                    return self._after_count(ForwardTerminal(step.forward, unless_ended=True))
                return [Forward(step.forward)]
            return []
        return self._apply(step, None)

    def _trailers(self) -> list[StreamAction]:
        if self.s.life.ended:
            return []
        step = self.meter.feed(b"", False)
        if not step.forward:
            return []
        fwd = step.forward
        if self.complete and not self._final_sent:
            return self._after_count(ForwardTerminal(fwd, unless_ended=False))
        return [Forward(fwd, False, self._terminal_output())]

    def _after_count(self, resume: Resume) -> list[StreamAction]:
        """Run ``resume`` once the exact input count its figures need is taken (at once when
        none is needed; else after the server reports :class:`CountDone`)."""
        if self.s.needs_count:
            self._awaiting_count = AwaitingCount(resume)
            return [CountInput()]
        return self._resume(resume)

    def _resume(self, r: Resume) -> list[StreamAction]:
        """What waited for the count."""
        if type(r) is ApplyStep:
            # cut meanwhile (shutdown): that cut has said it all
            return [] if self.s.life.ended else self._apply_counted(r.step, r.then)
        if type(r) is ForwardTerminal:
            if r.unless_ended and self.s.life.ended:
                return []  # cut meanwhile (shutdown): it said it all
            return [Forward(r.data, False, self._terminal_output())]
        assert isinstance(r, CutCorrupt)
        reason, message = CutReason.UNMETERABLE, "The upstream sent a corrupt compressed body."
        return self._cut(reason, message) + list(r.late)

    def _then(self, then: Then) -> list[StreamAction]:
        """What follows a step: the chunk still to meter, unless the stream ended."""
        if then is None or self.s.life.ended:
            return []
        return self._feed(then.data, then.end)

    def _apply(self, step: Step, then: Then) -> list[StreamAction]:
        """Forward what the meter released, ask for charges, wait when events are held; then
        ``then`` (unless the stream must wait first)."""
        meter = self.meter
        if step.cut_reason is not None or step.end_stream or meter.complete:
            return self._after_count(ApplyStep(step, then))
        return self._apply_counted(step, then)

    def _apply_counted(self, step: Step, then: Then) -> list[StreamAction]:
        out: list[StreamAction] = []
        if step.cut_reason is not None:
            if step.forward:
                out.append(Forward(step.forward))
            out += self._cut(step.cut_reason)
            return out
        if step.forward or step.end_stream:
            if step.end_stream:
                self.s.life.advance(Input.END)
            final = self._final_output() if step.end_stream else self._terminal_output()
            out.append(Forward(step.forward, step.end_stream, final))
        if step.charge:
            out.append(self._start_charge(step.charge))
        if not step.blocked:
            return out + self._then(then)
        if not self._in_flight:  # nothing in flight: cannot happen, but never stall a stream
            out.append(StalledWithoutCharge())
            return out + self._apply(self.meter.stop_enforcing(), then)
        self._awaiting_charge = AwaitingCharge(then)
        out.append(AwaitCharge())
        return out

    # -- figures ---------------------------------------------------------------------------

    def _final_output(self) -> int:
        """The final output figure (decided once, the one settlement charges); a completed
        stream names its ending."""
        self._final_sent = True
        got = self.s.stream_output(self.end())
        out = got if isinstance(got, int) else got.value
        if self.complete:
            self.s.life.name_ending(Ending.COMPLETED)
        return out

    def _terminal_output(self) -> int | None:
        """The final figures on the response carrying the terminal event (once): a client that
        closes right after ``[DONE]`` leaves no later response to carry them."""
        if self._final_sent or not self.complete:
            return None
        return self._final_output()

    # -- charges ---------------------------------------------------------------------------

    def _start_charge(self, amount: int) -> StartCharge:
        # per-token buckets only, in the order the limiter returns their values
        now = self._now_ms()
        self._charge_buckets = tuple(
            b for b in self.s.buckets_at(self._prefix, now, self._lease_ms) if b.kind == "tpm"
        )
        self._seq += 1
        self._in_flight = True
        return StartCharge(
            self._seq,
            self._charge_buckets,
            admission_plan.token_charges(list(self._charge_buckets), amount),
            amount,
            self.meter.strict,
        )

    def _take(self, ev: ChargeAnswered | ChargeFailed) -> tuple[list[StreamAction], Step]:
        """Apply a charge's answer to the account and the meter."""
        self._in_flight = False
        meter = self.meter
        buckets = self._charge_buckets
        if isinstance(ev, ChargeFailed):
            if ev.maybe_ran:  # it may still run once Redis answers: settlement takes it back
                self.s.unconfirmed = unconfirmed_charge(self._seq, buckets)
            meter.on_charge_failed()
            if self._fail_open:
                return [ChargeError(unmetered=True)], meter.stop_enforcing()
            return [ChargeError(unmetered=False)], meter.fail(CutReason.BACKEND_UNAVAILABLE)
        self.s.account.record_output(list(buckets), ev.granted)
        self._last = (buckets, ev.values)
        side: list[StreamAction] = []
        for b, v in zip(buckets, ev.values, strict=True):
            if b.limit.shadow and v > b.limit.limit and b.key not in self._shadowed:
                # a shadow limit taken past its limit: counted and logged once, never cut
                self._shadowed.add(b.key)
                side.append(ShadowExceeded(b.metric, admission_plan.describe(b.limit), v))
        return side, meter.on_charge(ev.granted, ev.exhausted, room_after(buckets, ev.values))

    # -- cutting ---------------------------------------------------------------------------

    def _cut(self, reason: CutReason, message: str | None = None) -> list[StreamAction]:
        """End the stream now with the API's error event for ``reason``."""
        s, meter = self.s, self.meter
        api = s.api
        assert api is not None
        if s.life.ended:
            return []
        s.life.cut(reason)
        budget = False
        limit = None
        if reason is CutReason.QUOTA_EXHAUSTED:
            assert s.tenant is not None
            buckets, values = self._last
            # what each counter will hold once settlement charges what was delivered
            message, budget, limit = quota_cut(
                tenant=s.tenant.id,
                charged=[
                    (b, v + s.pending_units(b, meter.delivered))
                    for b, v in zip(buckets, values, strict=True)
                ],
                admitted=list(s.buckets),
                delivered=meter.delivered,
                now_ms=self._now_ms(),
            )
        err = cut_error(reason.value, message, budget=budget, limit=limit)
        if isinstance(api, ResponsesFormat):  # its events are numbered: continue the count
            seq = getattr(self.reader, "last_sequence_number", None)
            data = meter.cut(api.cut_events(err, sequence_number=seq))
        else:
            data = meter.cut(api.cut_events(err))
        charged = s.account.total
        return [Cut(reason, data, err, self._final_output(), meter.delivered, charged)]
