"""One request as a sans-IO session: its phase records (:mod:`extproc.core.phase_records`, each set
once), its lifecycle, its two sub-machines (admission, the metered stream:
:mod:`extproc.core.sub_machines`), all fed through :meth:`Session.handle`, and the decisions that
read them.  Besides the records it keeps two accumulators of limiter answers, changed only by
its own methods (and by its metered stream): the :class:`RequestAccount` (what each counter was
charged) and the last stream charge whose answer never came.

The rules it applies live by job: trusted upstream figures and abandons in
:mod:`extproc.core.figures`, how a response is metered in :mod:`extproc.core.classify`, the
per-request policies in :mod:`extproc.core.policies`, settlement in the pure planner
:mod:`extproc.core.settlement`, the input figure's standing in :mod:`extproc.core.input_state`,
a bound's count and note in :mod:`extproc.core.bound_count`, admission in
:mod:`extproc.core.admission_flow`.  The server layer executes what they decide.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import overload

from extproc.core import envelope
from extproc.core.account import RequestAccount
from extproc.core.actions import AdmissionAction, StreamAction
from extproc.core.classify import classify, parse_status
from extproc.core.encoding import BodyDecoder
from extproc.core.envelope import EnvelopeAction, EnvelopeEvent
from extproc.core.events import AdmissionEvent, BodyArrived, RpmOnlyArrived, StreamEvent
from extproc.core.figures import Figure
from extproc.core.input_state import (
    COUNTED_AFTER_BOUND,
    PENDING,
    UNCOUNTED,
    InputEvent,
    InputState,
    move,
)
from extproc.core.keys import WindowedBucket
from extproc.core.lifecycle import Closed, Ending, Input, Lifecycle, State
from extproc.core.phase_records import (
    Admitted,
    Metering,
    PhaseError,
    Reported,
    Responding,
    StreamEnd,
)
from extproc.core.rules import Adjustment, UnconfirmedCharge, Usage
from extproc.core.session_records import SessionRecords
from extproc.core.settlement import (
    CountFirst,
    SettleFacts,
    SettlementPlan,
    corrections,
    input_figure,
    json_output,
    settle,
    stream_output,
    upstream_input,
)
from extproc.core.sub_machines import (
    ADMISSION_EVENTS,
    STREAM_EVENTS,
    AdmissionMachine,
    Builders,
    StreamMachine,
)

#: The order of the upstream figures read in this process (:attr:`Session.report_seq`).
_REPORTS = itertools.count(1)


class Session(SessionRecords):
    """One request: its lifecycle, its phase records (each set once) and its account."""

    __slots__ = (
        "_admission",
        "_builders",
        "_count",
        "_count_inline",
        "_counted",
        "_input",
        "_output",
        "_settlement",
        "_stream",
        "account",
        "life",
        "report_seq",
        "unconfirmed",
    )

    def __init__(self, builders: Builders | None = None) -> None:
        super().__init__()
        self.life = Lifecycle()
        # how the sub-machines are built (None: a session driven by its envelope alone)
        self._builders = builders
        self._admission: AdmissionMachine | None = None
        self._stream: StreamMachine | None = None
        # the exact input count of a request admitted on a bound (None: not taken)
        self._counted: int | None = None
        # where the input figure stands (every flag about it is read off this state)
        self._input = InputState.EXACT
        # the order in which the upstream's figures were read, in this process (0: none yet):
        # which bills a later count vouches for (extproc.core.audits)
        self.report_seq = 0
        self._output: Figure | int | None = None
        self._settlement: SettlementPlan | None = None
        # the exact input count of a request admitted on a bound, taken when a figure needs it
        self._count: Callable[[], int] | None = None
        self._count_inline = True
        self.account = RequestAccount()
        # the last stream charge whose answer never came (settlement undoes it if it ran)
        self.unconfirmed: UnconfirmedCharge | None = None

    # -- records -----------------------------------------------------------------------------

    def admit(self, rec: Admitted, usage: Usage | None = None) -> None:
        """Admission said yes; ``usage`` is what it charged (None: nothing, fail-open)."""
        if self._admitted is not None:
            raise PhaseError("the request was admitted twice")
        self._admitted = rec
        self._cost = rec.cost
        if rec.input_bound:
            self._input = move(self._input, InputEvent.ON_BOUND)
        if usage is not None:
            self.account.record(list(rec.buckets), usage)

    def count_input_with(self, count: Callable[[], int], *, inline: bool = True) -> None:
        """How to count the input exactly, for a request admitted on an upper bound: called at
        most once, only when a figure needs the count (:meth:`needs_count`).  A prompt too
        large to count on the event loop (``inline`` False) is never counted here: the server
        counts it in a worker thread (:meth:`input_counted`) before it asks for a figure."""
        self._count = count
        self._count_inline = inline

    def input_counted(self, exact: int, how: InputEvent = InputEvent.COUNTED) -> None:
        """The exact input count of a request admitted on an upper bound (once): it replaces
        the bound in the session's cost, so every later figure (cut messages, settlement,
        records) uses it; what admission charged stays in the admitted record and the
        account, so settlement refunds the difference.  ``how``: counted, the bound kept for a
        count that failed, or the upstream's figure adopted (:mod:`extproc.core.input_state`)."""
        rec = self._admitted
        if rec is None or not rec.input_bound or rec.cost is None or self._counted is not None:
            raise PhaseError("an exact input count for a request not admitted on a bound")
        if self._settlement is not None:
            raise PhaseError("the input count arrived after settlement was decided")
        self._input = move(self._input, how)
        self._counted = exact
        self._cost = replace(rec.cost, input_tokens=exact)

    @property
    def input_state(self) -> InputState:
        """Where the input figure stands."""
        return self._input

    @property
    def counted_after_bound(self) -> bool:
        """Admitted on a bound, and the exact count (or what stands for it) has replaced it."""
        return self._input in COUNTED_AFTER_BOUND

    @property
    def input_pending(self) -> bool:
        """Admitted on a bound whose exact count has not been taken."""
        return self._input in PENDING

    @property
    def input_uncounted(self) -> bool:
        """Billed (or about to be) at the upstream's own input figure without a count."""
        return self._input in UNCOUNTED

    @property
    def count_failed(self) -> bool:
        """The exact count could not be taken: the bound stands (an over-count)."""
        return self._input is InputState.KEPT_BOUND

    @property
    def needs_count(self) -> bool:
        """Whether a figure (settlement, a cut's message, the access log's input) would take
        the exact count now: the server takes it first, off the event loop if large."""
        adm = self._admitted
        if adm is None or not self.input_pending:
            return False
        return upstream_input(adm, self._counted, self._reported) is None

    def _exact_input(self) -> None:
        """Take the exact count of a request admitted on a bound.  A count that fails (it
        cannot for a body the bound walk accepted) leaves the bound: an over-count."""
        if not self.input_pending:
            return
        cost = self.cost
        assert cost is not None
        exact = cost.input_tokens
        how = InputEvent.COUNTED
        if self._count is not None and self._count_inline:
            try:
                exact = self._count()
            except Exception:
                how = InputEvent.COUNT_FAILED
        elif self._count is not None:
            # the server should have counted it off the loop first: never stall the loop, and
            # keep the bound (an over-count, logged at settlement)
            how = InputEvent.COUNT_FAILED
        self._count = None
        self.input_counted(exact, how)

    # -- the request, event by event: the server reports, the session moves its lifecycle ---

    @overload
    def handle(self, event: StreamEvent) -> list[StreamAction]: ...
    @overload
    def handle(self, event: AdmissionEvent) -> list[AdmissionAction]: ...
    @overload
    def handle(self, event: EnvelopeEvent) -> tuple[EnvelopeAction, ...]: ...
    def handle(
        self, event: StreamEvent | AdmissionEvent | EnvelopeEvent
    ) -> list[StreamAction] | list[AdmissionAction] | tuple[EnvelopeAction, ...]:
        """One event: the session moves (:mod:`extproc.core.envelope`), or the sub-machine whose
        event it is; the server executes the actions returned, in order.  The body (or an
        rpm_only path) starts admission."""
        t = type(event)
        if t in STREAM_EVENTS:
            stream = self._stream
            if stream is None:
                raise PhaseError(f"no metered stream takes {t.__name__}")
            return stream.handle(event)
        if t in ADMISSION_EVENTS:
            adm = self._admission
            if adm is None:
                if t is not BodyArrived and t is not RpmOnlyArrived:
                    raise PhaseError(f"admission has not started: {t.__name__}")
                if self._builders is None:
                    raise PhaseError("a session built without builders has no admission")
                if t is BodyArrived:
                    self.request_body()
                adm = self._admission = self._builders.admission(self)
            return adm.handle(event)
        return envelope.handle(self, event)  # type: ignore[arg-type]

    def start_stream(self, decoder: BodyDecoder | None) -> None:
        """The response is metered as a stream: its machine starts (given builders)."""
        if self._stream is not None:
            raise PhaseError("the metered stream started twice")
        if self._builders is not None:
            self._stream = self._builders.stream(self, decoder)

    @property
    def stream(self) -> StreamMachine | None:
        """The metered stream's machine, once started."""
        return self._stream

    def request_headers(self) -> None:
        """The request's headers arrived."""
        self.life.advance(Input.REQUEST_HEADERS)

    def request_body(self) -> None:
        """The request's body arrived (admission follows)."""
        self.life.advance(Input.REQUEST_BODY)

    def admission_done(self) -> None:
        """Admission said yes (its record is set): the request goes upstream."""
        self.life.advance(Input.ADMITTED)

    def pass_through(self) -> None:
        """The path is not metered: the request passes as it is."""
        self.life.advance(Input.PASS)

    def answered(self, *, refused: bool) -> None:
        """The gateway answered the request itself: refused (429) or rejected (any other
        error)."""
        self.life.refuse(Ending.REFUSED if refused else Ending.REJECTED)

    @property
    def ending(self) -> Ending | None:
        """How the request ended, once it has."""
        return self.life.ending

    # -- the response, event by event: the server reports, the session moves its lifecycle --

    def response_headers(
        self, headers: dict[str, str], *, end_of_stream: bool, fail_open: bool
    ) -> Metering:
        """The response's headers arrived: how its body is metered (:func:`classify`), recorded
        once, and the lifecycle moved to match (a local reply or an upstream error names the
        ending; a response that needs no body read ends here; a body the meter cannot read
        ends here too when the plan fails open, else it is answered with a 502)."""
        before = self.life.state
        self.life.advance(Input.RESPONSE_HEADERS)
        how = classify(
            headers,
            before,
            parsed=self.parsed,
            admitted=self.admitted,
            api=self.api,
            end_of_stream=end_of_stream,
        )
        status = parse_status(headers)
        kind = how.kind
        if kind == "unmeterable" and not fail_open:
            status = 502  # the gateway answers instead of the upstream
        self.respond(Responding(status, how))
        if kind == "local_reply":  # Envoy's own reply (413 before the body reached us...)
            self.life.name_ending(Ending.LOCAL_REPLY)
        elif kind == "upstream_error":
            self.life.name_ending(Ending.UPSTREAM_ERROR)
            self.life.advance(Input.END)
        elif kind == "stream":
            self.life.advance(Input.STREAM_START)
        elif kind in ("read_json", "exact"):
            self.life.advance(Input.READ_BODY)
        elif kind == "done" or (kind == "unmeterable" and fail_open):
            self.life.advance(Input.END)
        return how

    def response_body(self) -> None:
        """A response body chunk arrived."""
        self.life.advance(Input.RESPONSE_BODY)

    def response_trailers(self) -> None:
        """The response's trailers arrived."""
        self.life.advance(Input.TRAILERS)

    def response_read(self) -> None:
        """A JSON body was read to its end (its usage reported): the response is over."""
        self.life.advance(Input.END)

    @property
    def ended(self) -> bool:
        """The response is over (completed, cut or answered by the gateway)."""
        return self.life.ended

    @property
    def reading(self) -> bool:
        """A JSON body is being read for its usage."""
        return self.life.state is State.READING

    @property
    def streaming(self) -> bool:
        """A metered stream is running (not yet ended nor cut)."""
        return self.life.state is State.STREAMING

    @property
    def settling(self) -> bool:
        """Settlement has begun."""
        return self.life.settling

    def begin_settlement(self) -> bool:
        """True the first time (the caller settles), False afterwards."""
        return self.life.begin_settlement()

    def settle_ending(self) -> Ending:
        """How the request ended, for settlement: completed when nothing else was named."""
        self.life.name_ending(Ending.COMPLETED)
        ending = self.life.ending
        assert ending is not None
        return ending

    def report(self, rec: Reported) -> None:
        """The upstream's usage (a stream may report more than once: the last one stands)."""
        if self._output is not None:
            return  # the figures are decided: a late report changes nothing
        self._reported = rec
        self.report_seq = next(_REPORTS)

    @property
    def settled(self) -> SettlementPlan | None:
        """The settlement's plan once decided (:meth:`settlement`), else None."""
        return self._settlement

    # -- decisions ---------------------------------------------------------------------------

    def json_output(self) -> Figure | None:
        """A JSON response's output figure: the upstream's usage within bounds (decided once)."""
        cost = self.cost
        if cost is None:
            return None
        fig = json_output(self._output, self._reported, cost)
        if fig is not None:
            self._output = fig
        return fig

    def stream_output(self, end: StreamEnd) -> Figure | int:
        """A stream's output, decided once it is final: the upstream's usage within bounds when
        the stream completed and reported one, otherwise the tokens delivered to the client.

        Called for the last response's metadata and again at settlement: the second call
        returns the first answer, so a disagreement is logged and counted once."""
        self._output = out = stream_output(self._output, self._reported, self.cost, end)
        return out

    @property
    def output_decided(self) -> int | None:
        """The output figure, once decided."""
        out = self._output
        if out is None:
            return None
        return out.value if isinstance(out, Figure) else out

    def input_figure(self) -> Figure | int:
        """Input to charge (:func:`extproc.core.settlement.input_figure`): the upstream's
        figure within bounds around the gateway's count, or the gateway's count when the
        upstream gave none."""
        adm, cost = self._admitted, self._cost
        assert adm is not None and cost is not None
        got = input_figure(adm, cost, self._counted, self._reported, self.req)
        if isinstance(got, CountFirst):
            self._exact_input()  # the server counts first; this is the fallback
            got = input_figure(adm, self._cost or cost, self._counted, self._reported, self.req)
            assert not isinstance(got, CountFirst)
        figure, uncounted = got
        if uncounted:  # the engine's own count, under a proven bound
            self._input = move(self._input, InputEvent.SHOWN_UNCOUNTED)
        return figure

    def input_tokens(self) -> int:
        """The input figure as a number."""
        got = self.input_figure()
        return got.value if isinstance(got, Figure) else got

    def stream_closed(self, how: Closed, *, stream_complete: bool = False) -> Ending:
        """The gRPC stream closed. A stream whose terminal event reached the client completed,
        whoever closed first; one closed before its end was abandoned by the client (Envoy
        closes the processor's stream the same way for a client that leaves and an upstream
        that resets: the client leaving is by far the common cause, and an upstream reset is
        named by the client's own error, not by the bill)."""
        if stream_complete:
            self.life.name_ending(Ending.COMPLETED)
        return self.life.close(how)

    def settlement(
        self,
        now_ms: int,
        *,
        stream: StreamEnd | None = None,
        ending: Ending | None = None,
        abandon_rate: int | None = None,
        abandon_start_ms: int = 0,
        first_chunk_ms: int = 0,
        shortcut: bool = False,
    ) -> SettlementPlan:
        """The request's settlement (decided once, :func:`extproc.core.settlement.settle`).
        ``abandon_rate``: tokens per second per sequence a request abandoned before a response
        the gateway could meter is billed at (the model's learned decode rate,
        :mod:`extproc.core.decode_rate`), from ``abandon_start_ms`` after admission (its learned
        time to the first token); None: the model's configured one, from admission.
        ``first_chunk_ms``: when the response's first chunk came (0: not read by chunk);
        ``shortcut``: the model may be billed at the upstream's input figure without a count."""
        if self._settlement is not None:
            return self._settlement
        ending = ending or self.life.ending or Ending.COMPLETED

        def facts() -> SettleFacts:
            adm, cost = self._admitted, self._cost
            assert adm is not None and cost is not None
            return SettleFacts(
                ending=ending,
                now_ms=now_ms,
                status=self.status,
                admitted=adm,
                cost=cost,
                counted=self._counted,
                reported=self._reported,
                decided_output=self._output,
                stream=stream,
                req=self.req,
                charged=self.account.total,
                uncounted=self.input_uncounted,
                shortcut=shortcut,
                abandon_rate=abandon_rate,
                abandon_start_ms=abandon_start_ms,
                first_chunk_ms=first_chunk_ms,
            )

        plan = settle(facts())
        if isinstance(plan, CountFirst):
            self._exact_input()  # the server counts first; this is the fallback
            plan = settle(facts())
            assert not isinstance(plan, CountFirst)
        if plan.adopt_input is not None:
            self.input_counted(plan.adopt_input, InputEvent.ADOPTED)
        elif plan.uncounted:
            self._input = move(self._input, InputEvent.SHOWN_UNCOUNTED)
        if plan.output_figure is not None:
            self._output = plan.output_figure
        self._settlement = plan
        return plan

    def adjustments(self, plan: SettlementPlan, current: list[WindowedBucket]) -> list[Adjustment]:
        """Corrections that make every per-token counter hold the settlement's units."""
        return corrections(plan, self.account, current)

    def pending_units(self, bucket: WindowedBucket, delivered: int) -> int:
        """Units settlement would still add to ``bucket`` if the stream ended now with
        ``delivered`` output tokens (what a cut message must add to the counter's value)."""
        cost = self.cost
        if cost is None or not bucket.limit.counts_tokens:
            return 0
        # the input as settlement will take it (the upstream's figure in range, or the count)
        final = Usage(input=self.input_tokens(), output=delivered, requests=cost.requests)
        return bucket.rates.units(final) - self.account.charged(bucket.limit)
