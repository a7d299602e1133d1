"""A metered response stream, driven by events: the session's stream part, sans-IO.

The server feeds :class:`MeteredStream`, through the session, the events it sees and executes
the actions it returns, in order (its vocabulary, :mod:`extproc.core.stream_vocabulary`).
Every decision is taken here: what passes, when to charge and on which buckets, what an
answer means (the room it leaves, a shadow limit crossed, fail-open or a cut), the cut's
message, the final figures and the lifecycle's moves (its end, its cut).  The server owns the
I/O: the charge task, the wait for it, the count off the event loop, bytes, metrics and logs.

The stream is in one :class:`~extproc.core.stream_states.StreamState` at a time (metering,
awaiting the charge that holds events, awaiting the exact input count, ended).
:data:`TRANSITIONS` lists every legal ``(state, event type)`` pair with its step and the states
it may lead to; :meth:`MeteredStream.handle` looks the pair up (one not listed, such as a count
out of turn or a chunk while a wait is out, is a PhaseError and moves nothing).  A step that
waits asks for the answer as its last action (``AwaitCharge``, ``CountInput``) and leaves what
follows as data for the step that takes it.  :meth:`MeteredStream.chunk`'s common case (no
answer, nothing to charge, cut or wait for) is the (METERING, BodyChunk) step run inline.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, Final

from extproc.core import admission_plan
from extproc.core import stream_vocabulary as sv
from extproc.core.apis.errors import cut_error, quota_cut
from extproc.core.apis.responses import ResponsesFormat
from extproc.core.encoding import BodyDecoder
from extproc.core.keys import WindowedBucket, room_after, unconfirmed_charge
from extproc.core.lifecycle import CutReason, Ending, Input
from extproc.core.meter import Step, StreamMeter
from extproc.core.phase_records import PhaseError, Reported, StreamEnd
from extproc.core.session import Session
from extproc.core.stream_states import (
    ApplyStep,
    CutCorrupt,
    FeedNext,
    ForwardTerminal,
    Pending,
    Resume,
    StreamState,
    Then,
)

#: How long settlement waits for the answer of a charge still in flight before it settles
#: without it (the charge is then marked unconfirmed: counted once whichever runs first).
CHARGE_WAIT_SECONDS: Final = 1.0
_S = StreamState
_METERING: Final = StreamState.METERING
_Answer = sv.ChargeAnswered | sv.ChargeFailed


class MeteredStream:
    """One metered response stream: its meter, its charges, its cut and its final figures."""

    __slots__ = (
        "_charge_buckets",
        "_decoder",
        "_fail_open",
        "_final_sent",
        "_in_flight",
        "_last",
        "_lease_ms",
        "_now_ms",
        "_pending",
        "_prefix",
        "_seq",
        "_shadowed",
        "_state",
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
        self._state = _METERING
        self._pending: Pending = None  # what a wait state resumes with (read in it only)

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
    def state(self) -> StreamState:
        """Where the stream is (a wait state: what the server must answer next)."""
        return self._state

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

    def handle(self, ev: sv.StreamEvent) -> list[sv.StreamAction]:
        """Take one event; return what the server must do, in order (the step
        :data:`TRANSITIONS` names; a body chunk's common case inline, :meth:`chunk`)."""
        if type(ev) is sv.BodyChunk:
            return self.chunk(ev.data, ev.end, ev.answer)
        return self._dispatch(ev)

    def _dispatch(self, ev: sv.StreamEvent) -> list[sv.StreamAction]:
        state = self._state
        if state is _METERING and self.s.life.ended:
            # the response ended outside the stream (the gateway answered instead)
            state = self._state = _S.ENDED
        entry = TRANSITIONS.get((state, type(ev)))
        if entry is None:
            raise PhaseError(f"the stream cannot take {type(ev).__name__} in state {state.value}")
        answer = ev.answer if isinstance(ev, sv.BodyChunk) else ev
        if isinstance(answer, _ANSWERS) and not self._in_flight:  # a duplicate: none is out
            raise PhaseError("the stream cannot take an answer with no charge out")
        step, allowed = entry
        out: list[sv.StreamAction] = []
        to = step(self, ev, out)
        if to not in allowed:  # a step the table does not allow
            raise PhaseError(f"the stream may not move from {state.value} to {to.value}")
        self._state = to
        return out

    def chunk(self, data: bytes, end: bool, answer: _Answer | None = None) -> list[sv.StreamAction]:
        """``handle(sv.BodyChunk(data, end, answer))`` without building the event (as h2's
        ``receive_data``); the session's lifecycle takes the chunk first."""
        life = self.s.life
        if answer is None and self._state is _METERING and self._decoder is None and not life.ended:
            # (METERING, BodyChunk) inline: the common case needs no lookup
            life.advance(Input.RESPONSE_BODY)
            meter = self.meter
            step = meter.feed(data, end)
            if (
                step.charge == 0
                and not (step.blocked or step.cut_reason or step.end_stream)
                and (not meter.complete or self._final_sent)
            ):
                # The common case: forward what completed, no charge, no wait.
                return [sv.Forward(step.forward)] if step.forward else []
            out = self._stepped(step)
            self._state = self._after(out)  # the table's entry allows any state
            return out
        return self._dispatch(sv.BodyChunk(data, end, answer))

    # -- the steps: (state, event) -> actions (into ``out``), the next state ----------------

    def _after(self, out: list[sv.StreamAction]) -> StreamState:
        """Where a step's actions leave the stream: the wait its last one asks for, or not."""
        if out:
            last = type(out[-1])
            if last is sv.AwaitCharge:
                return _S.AWAITING_CHARGE
            if last is sv.CountInput:
                return _S.AWAITING_COUNT
        return _S.ENDED if self.s.life.ended else _METERING

    def _stay(self, ev: Any, out: list[sv.StreamAction]) -> StreamState:
        """Nothing to do: the event changes nothing (trailers or a cut after the end)."""
        return self._state

    def _on_chunk(self, ev: sv.BodyChunk, out: list[sv.StreamAction]) -> StreamState:
        """METERING + a body chunk, decoded, after the charge's answer that came before it."""
        self.s.life.advance(Input.RESPONSE_BODY)
        data, end, answer = ev.data, ev.end, ev.answer
        if self._decoder is not None:
            try:
                data = self._decoder.feed(data) + (self._decoder.flush() if end else b"")
            except zlib.error:
                late = self._take(answer)[0] if answer is not None else []
                out += self._after_count(CutCorrupt(tuple(late)))
                return self._after(out)
        if answer is not None:
            # A charge answered since the last chunk: it may release held events, ask for the
            # next charge, or cut the stream. None of that may be dropped.
            side, answered = self._take(answer)
            out += side
            if (
                answered.forward
                or answered.charge
                or answered.blocked
                or answered.cut_reason
                or answered.end_stream
            ):
                out += self._apply(answered, FeedNext(data, end))
                return self._after(out)
        out += self._feed(data, end)
        return self._after(out)

    def _on_chunk_ended(self, ev: sv.BodyChunk, out: list[sv.StreamAction]) -> StreamState:
        """ENDED + a body chunk: its answer still counts (its units are in Redis)."""
        self.s.life.advance(Input.RESPONSE_BODY)
        if ev.answer is not None:
            out += self._take(ev.answer)[0]
        return _S.ENDED

    def _on_trailers(self, ev: sv.Trailers, out: list[sv.StreamAction]) -> StreamState:
        """METERING + trailers: flush what the meter holds (with the final figures)."""
        out += self._trailers()
        return self._after(out)

    def _on_answer(self, ev: _Answer, out: list[sv.StreamAction]) -> StreamState:
        """The charge's answer: applied to the account and the meter; unless late, its step
        and what waited for it (in AWAITING_CHARGE) follow."""
        side, step = self._take(ev)
        out += side
        then = self._pending if self._state is _S.AWAITING_CHARGE else None
        assert then is None or isinstance(then, FeedNext)
        self._pending = None
        if not ev.late:  # late: settlement collected it, bookkeeping only (a wait is over)
            out += self._apply(step, then)
        return self._after(out)

    def _on_late_answer(self, ev: _Answer, out: list[sv.StreamAction]) -> StreamState:
        """An answer while the count is awaited or after the end: bookkeeping only."""
        out += self._take(ev)[0]
        return self._state

    def _on_count(self, ev: sv.CountDone, out: list[sv.StreamAction]) -> StreamState:
        """AWAITING_COUNT + the count: what waited for it."""
        resume = self._pending
        assert resume is not None and not isinstance(resume, FeedNext)
        self._pending = None
        out += self._resume(resume)
        return self._after(out)

    def _on_cut(self, ev: sv.CutNow, out: list[sv.StreamAction]) -> StreamState:
        """The server cuts the stream (shutdown); a wait stays (what waited sees the end)."""
        out += self._cut(ev.reason, ev.message)
        return _S.ENDED if self._state is _METERING else self._state

    def _on_abandoned(self, ev: sv.ChargeAbandoned, out: list[sv.StreamAction]) -> StreamState:
        """Settlement stopped waiting for the charge in flight: it is marked unconfirmed."""
        if self._in_flight and self._seq > 0:
            self.s.unconfirmed = unconfirmed_charge(self._seq, self._charge_buckets)
        return self._state

    def _feed(self, data: bytes, end: bool) -> list[sv.StreamAction]:
        return self._stepped(self.meter.feed(data, end))

    def _stepped(self, step: Step) -> list[sv.StreamAction]:
        """What follows the meter's ``step`` for a body chunk."""
        meter = self.meter
        if step.charge == 0 and not (step.blocked or step.cut_reason or step.end_stream):
            # The common case: forward what completed, no charge, no wait (the final figures
            # go with the terminal event only: none before the meter saw it; a large prompt's
            # count, when they need it, is asked for then, once).
            if step.forward:
                if meter.complete and not self._final_sent:
                    return self._after_count(ForwardTerminal(step.forward, unless_ended=True))
                return [sv.Forward(step.forward)]
            return []
        return self._apply(step, None)

    def _trailers(self) -> list[sv.StreamAction]:
        step = self.meter.feed(b"", False)
        if not step.forward:
            return []
        fwd = step.forward
        if self.complete and not self._final_sent:
            return self._after_count(ForwardTerminal(fwd, unless_ended=False))
        return [sv.Forward(fwd, False, self._terminal_output())]

    def _after_count(self, resume: Resume) -> list[sv.StreamAction]:
        """Run ``resume`` once the exact input count its figures need is taken (at once when
        none is needed; else after the server reports :class:`CountDone`)."""
        if self.s.needs_count:
            self._pending = resume
            return [sv.CountInput()]
        return self._resume(resume)

    def _resume(self, r: Resume) -> list[sv.StreamAction]:
        """What waited for the count."""
        if type(r) is ApplyStep:
            # cut meanwhile (shutdown): that cut has said it all
            return [] if self.s.life.ended else self._apply_counted(r.step, r.then)
        if type(r) is ForwardTerminal:
            if r.unless_ended and self.s.life.ended:
                return []  # cut meanwhile (shutdown): it said it all
            return [sv.Forward(r.data, False, self._terminal_output())]
        assert isinstance(r, CutCorrupt)
        reason, message = CutReason.UNMETERABLE, "The upstream sent a corrupt compressed body."
        return self._cut(reason, message) + list(r.late)

    def _then(self, then: Then) -> list[sv.StreamAction]:
        """What follows a step: the chunk still to meter, unless the stream ended."""
        if then is None or self.s.life.ended:
            return []
        return self._feed(then.data, then.end)

    def _apply(self, step: Step, then: Then) -> list[sv.StreamAction]:
        """Forward what the meter released, ask for charges, wait when events are held; then
        ``then`` (unless the stream must wait first)."""
        meter = self.meter
        if step.cut_reason is not None or step.end_stream or meter.complete:
            return self._after_count(ApplyStep(step, then))
        return self._apply_counted(step, then)

    def _apply_counted(self, step: Step, then: Then) -> list[sv.StreamAction]:
        out: list[sv.StreamAction] = []
        if step.cut_reason is not None:
            if step.forward:
                out.append(sv.Forward(step.forward))
            out += self._cut(step.cut_reason)
            return out
        if step.forward or step.end_stream:
            if step.end_stream:
                self.s.life.advance(Input.END)
            final = self._final_output() if step.end_stream else self._terminal_output()
            out.append(sv.Forward(step.forward, step.end_stream, final))
        if step.charge:
            out.append(self._start_charge(step.charge))
        if not step.blocked:
            return out + self._then(then)
        if not self._in_flight:  # nothing in flight: cannot happen, but never stall a stream
            out.append(sv.StalledWithoutCharge())
            return out + self._apply(self.meter.stop_enforcing(), then)
        self._pending = then
        out.append(sv.AwaitCharge())
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

    def _start_charge(self, amount: int) -> sv.StartCharge:
        # per-token buckets only, in the order the limiter returns their values
        now = self._now_ms()
        self._charge_buckets = tuple(
            b for b in self.s.buckets_at(self._prefix, now, self._lease_ms) if b.kind == "tpm"
        )
        self._seq += 1
        self._in_flight = True
        return sv.StartCharge(
            self._seq,
            self._charge_buckets,
            admission_plan.token_charges(list(self._charge_buckets), amount),
            amount,
            self.meter.strict,
        )

    def _take(self, ev: _Answer) -> tuple[list[sv.StreamAction], Step]:
        """Apply a charge's answer to the account and the meter."""
        self._in_flight = False
        meter = self.meter
        buckets = self._charge_buckets
        if isinstance(ev, sv.ChargeFailed):
            if ev.maybe_ran:  # it may still run once Redis answers: settlement takes it back
                self.s.unconfirmed = unconfirmed_charge(self._seq, buckets)
            meter.on_charge_failed()
            if self._fail_open:
                return [sv.ChargeError(unmetered=True)], meter.stop_enforcing()
            return [sv.ChargeError(unmetered=False)], meter.fail(CutReason.BACKEND_UNAVAILABLE)
        self.s.account.record_output(list(buckets), ev.granted)
        self._last = (buckets, ev.values)
        side: list[sv.StreamAction] = []
        for b, v in zip(buckets, ev.values, strict=True):
            if b.limit.shadow and v > b.limit.limit and b.key not in self._shadowed:
                # a shadow limit taken past its limit: counted and logged once, never cut
                self._shadowed.add(b.key)
                side.append(sv.ShadowExceeded(b.metric, admission_plan.describe(b.limit), v))
        return side, meter.on_charge(ev.granted, ev.exhausted, room_after(buckets, ev.values))

    # -- cutting ---------------------------------------------------------------------------

    def _cut(self, reason: CutReason, message: str | None = None) -> list[sv.StreamAction]:
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
        return [sv.Cut(reason, data, err, self._final_output(), meter.delivered, charged)]


#: A step of the machine: the stream, the event, the list its actions go to; the next state.
Transition = Callable[[MeteredStream, Any, list[sv.StreamAction]], StreamState]
_M = MeteredStream
_ANSWERS = (sv.ChargeAnswered, sv.ChargeFailed)
#: Where a step that meters (a chunk, an answer, the count) may lead: metering on, a wait, the end.
_ANY: Final = frozenset(StreamState)


#: Every legal ``(state, event type)`` pair: its step and the states it may lead to.  A pair not
#: listed (a chunk or trailers while a wait is out, a count out of turn or after the end) is a
#: PhaseError; an abandoned charge is bookkeeping anywhere; a cut in a wait leaves the wait on.
TRANSITIONS: dict[tuple[StreamState, type], tuple[Transition, frozenset[StreamState]]] = {
    (_S.METERING, sv.BodyChunk): (_M._on_chunk, _ANY),
    (_S.METERING, sv.Trailers): (_M._on_trailers, frozenset({_S.METERING, _S.AWAITING_COUNT})),
    (_S.METERING, sv.CutNow): (_M._on_cut, frozenset({_S.ENDED})),
    # an answer (a late one, collected by settlement: bookkeeping only, a wait for it over)
    **{
        (st, e): (_M._on_answer, _ANY) for st in (_S.METERING, _S.AWAITING_CHARGE) for e in _ANSWERS
    },
    **{
        (st, e): (_M._on_late_answer, frozenset({st}))
        for st in (_S.AWAITING_COUNT, _S.ENDED)
        for e in _ANSWERS
    },
    (_S.AWAITING_COUNT, sv.CountDone): (_M._on_count, _ANY),
    **{
        (w, sv.CutNow): (_M._on_cut, frozenset({w}))
        for w in (_S.AWAITING_CHARGE, _S.AWAITING_COUNT)
    },
    **{(s, sv.ChargeAbandoned): (_M._on_abandoned, frozenset({s})) for s in StreamState},
    (_S.ENDED, sv.BodyChunk): (_M._on_chunk_ended, frozenset({_S.ENDED})),
    **{(_S.ENDED, e): (_M._stay, frozenset({_S.ENDED})) for e in (sv.Trailers, sv.CutNow)},
}
