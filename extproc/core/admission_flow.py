"""Admission of one request as a state machine (sans-IO): explicit states, a transition table.

The admission waits in one :class:`AdmissionState` at a time: ready, awaiting the exact input
count, awaiting the limiter's answer to the admission call (planned on the exact count, on an
upper bound of the input, or an ``rpm_only`` path's call), or done.  :data:`TRANSITIONS` lists
every legal ``(state, event)`` pair with the step that handles it and the states that step may
lead to; :meth:`Admission.handle` looks the pair up (anything not listed, such as an answer
out of turn, a duplicate or a late one, is a :class:`~extproc.core.phase_records.PhaseError`
and moves nothing), runs the step and moves to the state it names, which the table must list.
Each step returns the actions the server executes in order; the last of a step that waits is
the one whose answer is the next event: ``CountExact`` or ``CallAdmit`` (the events and the
actions are admission's vocabulary, :mod:`extproc.core.admission_vocabulary`).  The rules, in
the order a request meets them:

1. the body's size, its parse (once: :class:`~extproc.core.phase_records.Parsed`), the model it
   asks for (an unknown one rejected or estimated);
2. an attempt as that model: on an upper bound of the input when the model's tokenizer has a
   proven one, the plan on it settles to actual figures and the counters were last seen with
   ample room (:func:`~extproc.core.admission_calls.bound_plan`), else on the exact count; a
   refused bound is counted exactly and asked again, so the bound never turns an answer;
3. the one admission call: its buckets, charges, lease and record draft, whether a refusal
   counts; a failure fails open or refuses as the plan says, a call that may have run (or a
   cancelled one) keeps a cancel;
4. a refusal by a limit on the requested model tries the plan's fallback model (its own
   buckets, a header tells the client), else the refusal is the answer;
5. the admitted record (its model, cost, buckets, headers, bound), the run-ahead budget, the
   shadow report and the body to forward.

A plan that waits (docs/semantics.md, "Waiting") may answer with a ticket: AWAITING_TURN until
``TurnCame`` (asked again) or ``WaitDeclined`` (asked once more, without a wait).

The server owns only the I/O: the count in a worker thread, the limiter call with the
settlements riding on it, the reclaimed records, metrics and log lines.  Client errors are
returned as :class:`~extproc.core.admission_vocabulary.Reject` (the server renders them in the API's own
shape, at its one error boundary).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from enum import Enum
from typing import Any, Final

from extproc.core import admission_plan, policies
from extproc.core import admission_vocabulary as av
from extproc.core.admission_calls import (
    Asked,
    admission_call,
    admitted,
    ask_call,
    bound_plan,
    fallback_model,
    parse_body,
    plan_for,
    read_answer,
    refusal_of,
    rpm_buckets,
    undo,
)
from extproc.core.admission_plan import AdmissionPlan
from extproc.core.admission_rules import AdmissionRules
from extproc.core.admission_wait import Waits
from extproc.core.keys import WindowedBucket
from extproc.core.phase_records import AdmitModel, Parsed, PhaseError
from extproc.core.room_hints import RoomHints
from extproc.core.rules import BucketCharge, Charging
from extproc.core.session import Session
from extproc.errors import (
    GatewayError,
    QuotaExceeded,
)


class AdmissionState(Enum):
    """Where one request's admission is."""

    __hash__ = object.__hash__  # as lifecycle.State's: looked up per event

    READY = "ready"  # nothing asked yet: the body (or an rpm_only path) starts it
    AWAITING_COUNT = "awaiting_count"  # av.CountExact is out: the exact input count comes next
    AWAITING_ADMISSION = "awaiting_admission"  # the call planned on the exact count is out
    AWAITING_BOUND_ADMISSION = "awaiting_bound_admission"  # the call planned on a bound is out
    AWAITING_RPM_ADMISSION = "awaiting_rpm_admission"  # an rpm_only path's one call is out
    AWAITING_TURN = "awaiting_turn"  # a ticket in the tenant's queue: Wait is out until its turn
    DONE = "done"  # forwarded, rejected, passed (rpm_only) or cancelled: nothing more is taken


#: The notes without a figure of their own, made once (every admission adds two of them).
_ON_BOUND: Final = av.InputAdmission("bound")
_RECOUNTED: Final = av.InputAdmission("recounted")
_COUNTED: Final = av.InputAdmission("exact")
_KEEP_LEASES: Final = av.KeepLeases()
_S = AdmissionState
#: The limiter's answers to a call out (a cancel aside).
_Answer = av.AdmitAnswered | av.AdmitFailed | av.AdmitBacklogged
#: The events that start an admission (fed again: "started twice").
_STARTS = (av.BodyArrived, av.RpmOnlyArrived)


class Admission:
    """One request's admission: fed events, returns actions (see the module's docstring)."""

    __slots__ = (
        "_asked",
        "_charging",
        "_first_refusal",
        "_model",
        "_now_ms",
        "_prefix",
        "_records",
        "_requested",
        "_room",
        "_size",
        "_state",
        "_w",
        "rules",
        "s",
    )

    def __init__(
        self,
        s: Session,
        rules: AdmissionRules,
        *,
        key_prefix: str,
        room: RoomHints,
        records: bool,
        now_ms: Callable[[], int],
    ) -> None:
        self.s = s
        self.rules = rules
        self._prefix = key_prefix
        self._room = room  # the counters' last seen values: whether a bound has room
        self._records = records  # usage records are written (a lease keeps a draft)
        self._now_ms = now_ms
        self._state = _S.READY
        self._size = 0  # the body's length (the count runs in a worker thread when large)
        self._requested: AdmitModel | None = None  # the model the body asks for
        self._model: AdmitModel | None = None  # the model of the attempt under way
        self._charging: Charging | None = None  # its charging (a level may make it strict)
        self._asked: Asked | None = None  # the admission call out, while one is
        # the requested model's refusal while its fallback is tried (its answer if that fails)
        self._first_refusal: QuotaExceeded | None = None
        self._w: Waits[Asked] = Waits()  # its waiting for its turn (a plan that waits)

    @property
    def state(self) -> AdmissionState:
        """Where the admission is."""
        return self._state

    # -- feeding ---------------------------------------------------------------------------

    def body(self, raw: bytes) -> list[av.AdmissionAction]:
        """The request body arrived: admit it (the last action forwards it or rejects)."""
        return self.handle(av.BodyArrived(raw))

    def rpm_only(self) -> list[av.AdmissionAction]:
        """An unmetered path under ``paths.other: rpm_only``: one request on the RPM buckets
        (no action left at the end: the request passes; or a rejection)."""
        return self.handle(av.RpmOnlyArrived())

    def handle(self, ev: av.AdmissionEvent) -> list[av.AdmissionAction]:
        """One event: the step :data:`TRANSITIONS` names for it in the current state runs and
        the admission moves to the state it returns; a client error raised on the way is the
        rejection that ends the admission."""
        state = self._state
        entry = TRANSITIONS.get((state, type(ev)))
        if entry is None:
            if isinstance(ev, _STARTS):
                raise PhaseError("admission started twice")
            raise PhaseError(f"admission cannot take {type(ev).__name__} in state {state.value}")
        step, allowed = entry
        out: list[av.AdmissionAction] = []
        try:
            to = step(self, ev, out)
        except GatewayError as err:
            out.append(av.Reject(err))
            to = _S.DONE
        if to not in allowed:  # a step the table does not allow
            raise PhaseError(f"admission may not move from {state.value} to {to.value}")
        self._state = to
        return out

    # -- the steps: (state, event) -> actions (into ``out``), the next state ----------------

    def _on_body(self, ev: av.BodyArrived, out: list[av.AdmissionAction]) -> AdmissionState:
        """READY + the body: check and parse it, resolve its model, start the first attempt."""
        req, model = parse_body(self.s, self.rules, ev.raw)
        self.s.parse(Parsed(req, model))
        self._size = len(ev.raw)
        self._requested = model
        return self._attempt(model, out)

    def _on_count(self, ev: av.InputCounted, out: list[av.AdmissionAction]) -> AdmissionState:
        """AWAITING_COUNT + the count: the call planned on it."""
        model, charging = self._model, self._charging
        assert model is not None and charging is not None
        plan = plan_for(self.s, self.rules, model, charging, ev.tokens)
        self._ask(model, plan, charging, out)
        return _S.AWAITING_ADMISSION

    def _on_bound_answer(self, ev: _Answer, out: list[av.AdmissionAction]) -> AdmissionState:
        """AWAITING_BOUND_ADMISSION + the answer: admitted on the bound, or (refused) counted
        exactly and asked again."""
        asked = self._answered()
        if type(ev) is av.AdmitAnswered and ev.wait and asked.queue is not None:
            out.append(self._w.wait(asked, ev, self.s.ledger, asked.queue))
            return _S.AWAITING_TURN
        res, refused = self._read(asked, ev, out, on_bound=True)
        if refused is None:
            out.append(_ON_BOUND)
            return self._attempted(asked, res, None, out, on_bound=True)
        model = self._model
        assert model is not None
        out.append(_RECOUNTED)
        out.append(av.CountExact(model, self._size))
        return _S.AWAITING_COUNT

    def _on_exact_answer(self, ev: _Answer, out: list[av.AdmissionAction]) -> AdmissionState:
        """AWAITING_ADMISSION + the answer: the attempt's outcome."""
        asked = self._answered()
        if type(ev) is av.AdmitAnswered and ev.wait and asked.queue is not None:
            out.append(self._w.wait(asked, ev, self.s.ledger, asked.queue))
            return _S.AWAITING_TURN
        res, refused = self._read(asked, ev, out, on_bound=False)
        return self._attempted(asked, res, refused, out, on_bound=False)

    def _on_turn(
        self, ev: av.TurnCame | av.WaitDeclined, out: list[av.AdmissionAction]
    ) -> AdmissionState:
        """AWAITING_TURN + its turn came: the same plan asked again, in now's windows; or the
        replica declines its wait (it holds its most waiters, or drains before the turn): asked
        once more without a wait (admitted if there is room now, else refused with its turn as
        ``retry-after`` and its ticket gone)."""
        asked, model, charging = self._w.take(), self._model, self._charging
        assert asked.plan is not None and model is not None and charging is not None
        self._w.declined = ev.why if type(ev) is av.WaitDeclined else ""
        self._ask(model, asked.plan, charging, out, on_bound=asked.on_bound)
        return _S.AWAITING_BOUND_ADMISSION if asked.on_bound else _S.AWAITING_ADMISSION

    def _on_rpm_only(self, ev: av.RpmOnlyArrived, out: list[av.AdmissionAction]) -> AdmissionState:
        """READY on an rpm_only path: the one call on the tenant-wide RPM buckets (none: the
        request passes)."""
        now = self._now_ms()
        buckets = rpm_buckets(self.s, prefix=self._prefix, now_ms=now)
        if not buckets:
            return _S.DONE
        call = admission_call(
            self.rules,
            buckets,
            admission_plan.RPM_ONLY,
            count_refused=policies.counts_refusal(
                on_bound=False, configured=self.rules.count_refused_requests
            ),
        )
        self._asked = Asked(call, None, tuple(buckets), now, leased=False)
        out.append(call)
        return _S.AWAITING_RPM_ADMISSION

    def _on_rpm_answer(self, ev: _Answer, out: list[av.AdmissionAction]) -> AdmissionState:
        """AWAITING_RPM_ADMISSION + the answer: the request passes, or a 429."""
        asked = self._answered()
        res = read_answer(self.rules, self.s.plan, asked.call, ev, out)
        if res is not None and not res.admitted and not res.duplicate:
            raise refusal_of(self.s, asked, res, "*")
        return _S.DONE

    def _on_cancel(self, ev: av.AdmitCancelled, out: list[av.AdmissionAction]) -> AdmissionState:
        """The request went away while waiting.  A call out may run (or have run) all the
        same: a cancel undoes it if it did, or stops it from ever running."""
        asked = self._asked
        if asked is not None:
            self._asked = None
            out.append(av.KeepCancel(undo(asked.call.charges), asked.call.ledger_ttl_ms))
        elif self._w.held is not None:
            asked = self._w.take()
        if asked is not None and asked.queue is not None:  # it may hold a ticket: it leaves
            out.append(av.LeaveQueue(self.s.ledger, asked.queue.keys))
        return _S.DONE

    # -- what the steps share ----------------------------------------------------------------

    def _attempt(self, model: AdmitModel, out: list[av.AdmissionAction]) -> AdmissionState:
        """Try the request as ``model``: the call on an upper bound of the input where the
        counters have ample room (:func:`~extproc.core.admission_calls.bound_plan`), otherwise
        the exact count first."""
        tenant = self.s.tenant
        assert tenant is not None
        out.append(av.Attempting(tenant.id, model.name))
        charging = self.rules.charging_for(tenant.plan, model.name)
        key = self.s.key
        if key is not None and tenant.strict_for(key.name) and charging.streaming != "strict":
            charging = replace(charging, streaming="strict")  # a level asks for it
        self._model, self._charging = model, charging
        bound = bound_plan(
            self.s,
            self.rules,
            model,
            charging,
            prefix=self._prefix,
            room=self._room,
            now_ms=self._now_ms,
        )
        if bound is not None:
            plan, now, buckets, charges = bound
            self._ask(model, plan, charging, out, on_bound=True, at=(now, buckets, charges))
            return _S.AWAITING_BOUND_ADMISSION
        out.append(_COUNTED)
        out.append(av.CountExact(model, self._size))
        return _S.AWAITING_COUNT

    def _answered(self) -> Asked:
        """The call out, answered: no longer out (a cancel from here keeps nothing of it)."""
        asked = self._asked
        assert asked is not None
        self._asked = None
        return asked

    def _attempted(
        self,
        asked: Asked,
        res: av.AdmitAnswered | None,
        refused: QuotaExceeded | None,
        out: list[av.AdmissionAction],
        *,
        on_bound: bool,
    ) -> AdmissionState:
        """An attempt's outcome (``res`` None: fail-open): admitted, or a refusal that the
        plan's fallback model may serve (the requested model's refusal is the answer if none
        does)."""
        model, charging, requested = self._model, self._charging, self._requested
        assert asked.plan is not None and requested is not None
        assert model is not None and charging is not None
        first = self._first_refusal
        if refused is not None:
            if first is not None:  # the fallback is refused too
                self.s.attempting(None)
                raise first
            # A limit on the requested model is exhausted: the plan may name another model
            # that still has room (its own buckets are charged; the client is told in a header).
            alt = fallback_model(
                self.s,
                self.rules,
                model,
                buckets=asked.buckets,
                answer=res,
                cost=asked.plan.cost,
            )
            if alt is None:
                raise refused
            self.s.attempting(alt)
            self._first_refusal = refused
            return self._attempt(alt, out)
        headers: tuple[tuple[str, str], ...] = ()
        if first is not None:
            out.append(av.LimitDecisions(((first.metric, "fallback"),)))
            out.append(av.FellBack(requested.name, model.name, first.code))
            headers = (
                ("x-aiquota-fallback-model", model.name),
                ("x-aiquota-requested-model", requested.name),
            )
        admitted(
            self.s,
            self.rules,
            model,
            asked.plan,
            charging,
            buckets=asked.buckets,
            now_ms=asked.now,
            res=res,
            headers=headers,
            on_bound=on_bound,
            out=out,
            waited_ms=self._w.waited_ms(asked.now, asked.queue),
        )
        return _S.DONE

    def _ask(
        self,
        model: AdmitModel,
        plan: AdmissionPlan,
        charging: Charging,
        out: list[av.AdmissionAction],
        *,
        on_bound: bool = False,
        at: tuple[int, list[WindowedBucket], list[BucketCharge]] | None = None,
    ) -> None:
        """The one admission call of ``plan`` (``at``: the time and buckets it was planned
        at and their charges, else now's), kept as the call out and asked (last)."""
        s, rules = self.s, self.rules
        charges: list[BucketCharge] | None = None
        if at is None:
            now = self._now_ms()
            listed = s.buckets_at(self._prefix, now, rules.reservation_lease_ms, model)
        else:
            now, listed, charges = at
        queue = self._w.queue(s, rules, self._prefix, listed, now)
        self._asked = asked = ask_call(
            s, rules, model, plan, listed, now, charges, self._records, on_bound, queue
        )
        out.append(asked.call)

    def _read(
        self, asked: Asked, ev: _Answer, out: list[av.AdmissionAction], *, on_bound: bool
    ) -> tuple[av.AdmitAnswered | None, QuotaExceeded | None]:
        """The answer to the call out (None: fail-open) and its refusal, if refused (counted
        unless the call was on a bound: that one is asked again)."""
        model, tenant = self._model, self.s.tenant
        assert asked.plan is not None and model is not None and tenant is not None
        res = read_answer(self.rules, self.s.plan, asked.call, ev, out)
        if res is not None and not res.admitted and not res.duplicate:
            err = refusal_of(self.s, asked, res, model.name)
            if asked.queue is not None:
                err = self._w.answered(err, res, asked.now, out) or err
            if not on_bound:
                out.append(av.LimitDecisions(((err.metric, "refused"),)))
            return res, err
        if res is not None and asked.queue is not None:
            self._w.answered(None, res, asked.now, out)
        if res is not None:
            # A duplicate can only be our own retried call (ledger ids are unique per HTTP
            # request): the first execution charged, so the request is admitted and metered.
            if res.duplicate:
                out.append(av.DuplicateAdmit())
            if asked.leased:
                out.append(_KEEP_LEASES)
        return res, None


#: A step of the machine: the admission, the event, the list its actions go to; the next state.
Step = Callable[[Admission, Any, list[av.AdmissionAction]], AdmissionState]
_A = Admission
_ANSWERS = (av.AdmitAnswered, av.AdmitFailed, av.AdmitBacklogged)
#: Where an attempt starts: the exact count asked for, or the call on a bound out.
_ATTEMPT_BEGUN = (_S.AWAITING_COUNT, _S.AWAITING_BOUND_ADMISSION)
#: The states of a call out after a turn.
_ASKED = (_S.AWAITING_ADMISSION, _S.AWAITING_BOUND_ADMISSION)
#: The states with an admission call out (a cancel there is kept).
_CALL_OUT = (_S.AWAITING_ADMISSION, _S.AWAITING_BOUND_ADMISSION, _S.AWAITING_RPM_ADMISSION)


def _to(*states: AdmissionState) -> frozenset[AdmissionState]:
    """The states a step may lead to: ``states``, or DONE (a client error or refusal ends the
    admission anywhere)."""
    return frozenset((*states, _S.DONE))


#: Every legal ``(state, event type)`` pair: the step that handles it and the states it may
#: lead to.  A pair not listed (an answer out of turn, a duplicate, a late answer after the
#: end, a second start) is a PhaseError.
TRANSITIONS: dict[tuple[AdmissionState, type], tuple[Step, frozenset[AdmissionState]]] = {
    (_S.READY, av.BodyArrived): (_A._on_body, _to(*_ATTEMPT_BEGUN)),
    (_S.READY, av.RpmOnlyArrived): (_A._on_rpm_only, _to(_S.AWAITING_RPM_ADMISSION)),
    (_S.AWAITING_COUNT, av.InputCounted): (_A._on_count, _to(_S.AWAITING_ADMISSION)),
    # the request went away while its input was counted: nothing is out, nothing to keep
    (_S.AWAITING_COUNT, av.AdmitCancelled): (_A._on_cancel, _to()),
    # refused on the bound: counted exactly and asked again
    # or told to wait for its turn (a plan that waits)
    **{
        (_S.AWAITING_BOUND_ADMISSION, e): (
            _A._on_bound_answer,
            _to(_S.AWAITING_COUNT, _S.AWAITING_TURN),
        )
        for e in _ANSWERS
    },
    # refused, with a fallback model: its attempt; or told to wait for its turn
    **{
        (_S.AWAITING_ADMISSION, e): (_A._on_exact_answer, _to(*_ATTEMPT_BEGUN, _S.AWAITING_TURN))
        for e in _ANSWERS
    },
    # the turn came (or the replica declined the wait): the same plan asked again
    **{(_S.AWAITING_TURN, e): (_A._on_turn, _to(*_ASKED)) for e in (av.TurnCame, av.WaitDeclined)},
    # the request went away while waiting: its ticket leaves the queue
    (_S.AWAITING_TURN, av.AdmitCancelled): (_A._on_cancel, _to()),
    **{(_S.AWAITING_RPM_ADMISSION, e): (_A._on_rpm_answer, _to()) for e in _ANSWERS},
    # the request went away while the call was out: a cancel is kept
    **{(state, av.AdmitCancelled): (_A._on_cancel, _to()) for state in _CALL_OUT},
}
