"""Admission of one request, driven by events: the session's admission part, sans-IO.

The server starts an :class:`Admission` on the request body (:meth:`Admission.body`) or on an
``rpm_only`` path (:meth:`Admission.rpm_only`), executes the actions it returns
(:mod:`extproc.core.actions`) in order, and feeds it the answer of the last one
(:mod:`extproc.core.events`): the exact input count, or the limiter's answer to the admission
call (answered, failed, cancelled, or not made for the settlement backlog).  Every decision is
taken here, in the order the flow reads:

1. the body's size, its parse (once: :class:`~extproc.core.phase_records.Parsed`), the model it
   asks for (an unknown one rejected or estimated);
2. an attempt as that model: on an upper bound of the input when the model's tokenizer has a
   proven one, the plan on it settles to actual figures and the counters were last seen with
   ample room (:meth:`_on_bound`), else on the exact count; a refused bound is counted
   exactly and asked again, so the bound never turns an answer;
3. the one admission call: its buckets, charges, lease and record draft, whether a refusal
   counts; a failure fails open or refuses as the plan says, a call that may have run keeps a
   cancel;
4. a refusal by a limit on the requested model tries the plan's fallback model (its own
   buckets, a header tells the client), else the refusal is the answer;
5. the admitted record (its model, cost, buckets, headers, bound), the run-ahead budget, the
   shadow report and the body to forward.

The server owns only the I/O: the count in a worker thread, the limiter call with the
settlements riding on it, the reclaimed records, metrics and log lines.  Client errors are
returned as :class:`~extproc.core.actions.Reject` (the server renders them in the API's own
shape, at its one error boundary).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from typing import Final, TypeVar

from extproc.core import admission_plan, policies
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
    LeaveQueue,
    LimitDecisions,
    PushedBack,
    Reject,
    ShadowRefused,
    Wait,
    WaitOver,
)
from extproc.core.admission_calls import (
    admission_call,
    draft_record,
    fallback_model,
    plan_for,
    undo,
)
from extproc.core.admission_plan import AdmissionPlan
from extproc.core.admission_rules import AdmissionRules, bound_input
from extproc.core.apis.base import RequestLimits
from extproc.core.counters import UTF8BoundCounter
from extproc.core.events import (
    AdmissionEvent,
    AdmitAnswered,
    AdmitBacklogged,
    AdmitCancelled,
    AdmitFailed,
    InputCounted,
    TurnCame,
    WaitDeclined,
)
from extproc.core.figures import run_ahead_budget
from extproc.core.keys import WindowedBucket, tenant_tag
from extproc.core.phase_records import AdmitModel, Admitted, Parsed, PhaseError
from extproc.core.room_hints import RoomHints
from extproc.core.rules import BucketCharge, Charging
from extproc.core.session import Session
from extproc.core.waiting import NEVER, QueueCall, bucket_kinds, priority_offset_ms, queue_keys
from extproc.errors import (
    BadRequest,
    GatewayError,
    LimiterUnavailable,
    QuotaExceeded,
    RequestTooLarge,
    UnknownModel,
)


@dataclass(slots=True)
class _Attempt:
    """Admission of the request as one model: the plan, the buckets, the answer (None:
    fail-open) and the refusal when refused."""

    plan: AdmissionPlan
    charging: Charging
    buckets: tuple[WindowedBucket, ...]
    now: int
    result: AdmitAnswered | None = None
    refused: QuotaExceeded | None = None
    on_bound: bool = False  # admitted on an upper bound of the input: count exactly after
    waited_ms: int = -1  # how long it waited for its turn (-1: its plan does not wait)


class _Cancelled(Exception):
    """The flow ends: the request went away (the server re-raises its cancellation)."""


#: The notes without a figure of their own, made once (every admission adds two of them).
_ON_BOUND: Final = InputAdmission("bound")
_RECOUNTED: Final = InputAdmission("recounted")
_COUNTED: Final = InputAdmission("exact")
_KEEP_LEASES: Final = KeepLeases()

_T = TypeVar("_T")
#: A step of the flow: it yields the actions the server answers with an event (the last of a
#: list), is sent each answer, and adds the others to the list as it goes.
_Flow = Generator[CountExact | CallAdmit | Wait, AdmissionEvent | None, _T]


class Admission:
    """One request's admission: fed events, returns actions (see the module's docstring)."""

    __slots__ = (
        "_arrival",
        "_begun",
        "_flow",
        "_now_ms",
        "_out",
        "_prefix",
        "_records",
        "_room",
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
        self._flow: _Flow[None] | None = None
        self._begun = False
        self._out: list[AdmissionAction] = []  # the actions of the step running
        self._arrival = 0  # when the request first asked (its wait's deadline counts from it)

    # -- feeding ---------------------------------------------------------------------------

    def body(self, raw: bytes) -> list[AdmissionAction]:
        """The request body arrived: admit it (the last action forwards it or rejects)."""
        return self._start(self._admit_body(raw))

    def rpm_only(self) -> list[AdmissionAction]:
        """An unmetered path under ``paths.other: rpm_only``: one request on the RPM buckets
        (no action left at the end: the request passes; or a rejection)."""
        return self._start(self._admit_rpm_only())

    def handle(self, ev: AdmissionEvent) -> list[AdmissionAction]:
        """The answer to the last action (a count, the admission call)."""
        if self._flow is None:
            raise PhaseError(f"admission is not waiting for an answer ({type(ev).__name__})")
        return self._run(ev)

    def _start(self, flow: _Flow[None]) -> list[AdmissionAction]:
        if self._begun:
            raise PhaseError("admission started twice")
        self._begun = True
        self._flow = flow
        return self._run(None)

    def _run(self, ev: AdmissionEvent | None) -> list[AdmissionAction]:
        """Run the flow until it asks for an answer or ends."""
        flow = self._flow
        assert flow is not None
        out: list[AdmissionAction] = []
        self._out = out
        try:
            out.append(flow.send(ev))
            return out
        except (StopIteration, _Cancelled):
            pass
        except GatewayError as err:
            out.append(Reject(err))
        self._flow = None
        return out

    # -- the flow --------------------------------------------------------------------------

    def _admit_body(self, raw: bytes) -> _Flow[None]:
        s, rules = self.s, self.rules
        api, tenant, key = s.api, s.tenant, s.key
        assert api is not None and tenant is not None and key is not None
        if len(raw) > rules.max_body_bytes:
            raise RequestTooLarge(
                f"the request body is {len(raw)} bytes; the limit is {rules.max_body_bytes}"
            )
        limits = RequestLimits(max_tokens_ceiling=rules.max_tokens_ceiling, max_n=rules.max_n)
        try:
            req = api.parse(raw, limits)
        except RecursionError:
            raise BadRequest("the request body is nested too deeply") from None
        model = rules.resolve_model(req.model)
        if model is None:
            if rules.unknown_model_action == "reject":
                raise UnknownModel(
                    f"The model '{req.model[:100]}' does not exist or you do not have access "
                    "to it.",
                    status=rules.unknown_model_status,
                )
            model = rules.unknown_model
        s.parse(Parsed(req, model))
        attempt = yield from self._attempt(model, len(raw))
        served = model
        headers: tuple[tuple[str, str], ...] = ()
        if attempt.refused is not None:
            # A limit on the requested model is exhausted: the plan may name another model
            # that still has room (its own buckets are charged; the client is told in a header).
            alt = fallback_model(
                self.s,
                self.rules,
                model,
                buckets=attempt.buckets,
                answer=attempt.result,
                cost=attempt.plan.cost,
            )
            if alt is None:
                raise attempt.refused
            s.attempting(alt)
            second = yield from self._attempt(alt, len(raw))
            if second.refused is not None:
                s.attempting(None)
                raise attempt.refused
            self._out.append(LimitDecisions(((attempt.refused.metric, "fallback"),)))
            self._out.append(FellBack(model.name, alt.name, attempt.refused.code))
            headers = (
                ("x-aiquota-fallback-model", alt.name),
                ("x-aiquota-requested-model", model.name),
            )
            attempt, served = second, alt
        plan, res = attempt.plan, attempt.result
        cost = plan.cost if res is not None else None
        budget = plan.budget
        if res is not None:
            budget = run_ahead_budget(
                budget,
                buckets=attempt.buckets,
                values=res.values,
                cost=plan.cost,
                sequences=req.sequences,
            )
            headers += tuple(
                admission_plan.rate_limit_headers(
                    list(attempt.buckets), res.values, attempt.now
                ).as_pairs()
            )
            shadow = policies.shadow_outcome(attempt.buckets, res.values, plan.cost)
            self._out.append(LimitDecisions(shadow.decisions))
            if shadow.exceeded:
                self._out.append(ShadowRefused(shadow.exceeded))
            headers += shadow.headers()
        if attempt.waited_ms >= 0:
            headers += (("x-ratelimit-waited-ms", str(attempt.waited_ms)),)
        floor = 0
        if attempt.on_bound and isinstance(served.bound_counter, UTF8BoundCounter):
            floor = served.bound_counter.fewest_tokens(plan.cost.input_tokens)
        s.admit(
            Admitted(
                served,
                cost,
                attempt.buckets,
                attempt.now,
                headers,
                input_bound=attempt.on_bound,
                input_floor=floor,
                waited_ms=max(0, attempt.waited_ms),
            ),
            admission_plan.admission_usage(cost) if cost is not None else None,
        )
        self._out.append(
            Decided(
                tenant=tenant.id,
                key=key.name,
                model=served.name,
                api=api.name,
                input_tokens=plan.cost.input_tokens,
                input_counted="after" if attempt.on_bound else "before",
                reserved_output=plan.cost.reserved_output,
                stream=req.stream,
                decision="admitted" if res is not None else "admitted_unmetered",
                mode=attempt.charging.mode,
                streaming=attempt.charging.streaming,
            )
        )
        self._out.append(
            ForwardBody(
                api.rewrite(
                    req,
                    budget=budget,
                    force_usage=rules.force_include_usage and plan.cost.meter_stream,
                    model=served.name if served.known else None,
                    continuous_usage=served.continuous_usage and plan.cost.meter_stream,
                    # admitted unmetered (fail-open): nothing meters the response, so it
                    # goes as the client sent it
                    upstream_stream=plan.cost.upstream_stream and res is not None,
                    stream_interval=served.exact_stream_interval,
                )
            )
        )

    def _attempt(self, model: AdmitModel, size: int) -> _Flow[_Attempt]:
        """Plan and run the one admission call as ``model``: on an upper bound of the input
        where the counters have ample room (:meth:`_on_bound`), otherwise on the exact count.
        A bound the limiter refuses is counted exactly and asked again: the bound never turns
        an answer."""
        tenant = self.s.tenant
        assert tenant is not None
        self._out.append(Attempting(tenant.id, model.name))
        charging = self.rules.charging_for(tenant.plan, model.name)
        key = self.s.key
        if key is not None and tenant.strict_for(key.name) and charging.streaming != "strict":
            charging = replace(charging, streaming="strict")  # a level asks for it
        bound = self._on_bound(model, charging)
        if bound is not None:
            plan, now, buckets, charges = bound
            out = yield from self._call(
                model, plan, charging, on_bound=True, at=(now, buckets, charges)
            )
            if out.refused is None:
                self._out.append(_ON_BOUND)
                return out
            self._out.append(_RECOUNTED)
        else:
            self._out.append(_COUNTED)
        ev = yield CountExact(model, size)
        if not isinstance(ev, InputCounted):
            raise PhaseError(f"admission waited for the input count, got {ev!r}")
        plan = plan_for(self.s, self.rules, model, charging, ev.tokens)
        return (yield from self._call(model, plan, charging))

    def _on_bound(
        self, model: AdmitModel, charging: Charging
    ) -> tuple[AdmissionPlan, int, list[WindowedBucket], list[BucketCharge]] | None:
        """The plan on an upper bound of the input, when admission may decide on it: the
        model's tokenizer has a proven bound, the bound is within the model's input limit, the
        request settles to its actual figures (a final-at-admission charge would keep the
        bound), and every per-token counter was last seen with ``bound_headroom`` times the
        charge free (and, for a metered stream, its whole output besides); with the time and
        buckets it was judged at and their charges (the call's own: made once)."""
        s, rules = self.s, self.rules
        api, req = s.api, s.req
        assert api is not None and req is not None
        if not policies.may_admit_on_bound(
            enabled=rules.admit_on_bound, proven_bound=model.bound_counter is not None
        ):
            return None
        bound = bound_input(api, req, model)
        if bound is None or not policies.bound_within(bound, model.max_input_tokens):
            return None
        plan = plan_for(self.s, self.rules, model, charging, bound)
        if not plan.cost.settle_to_actual:
            return None
        now = self._now_ms()
        buckets = s.buckets_at(self._prefix, now, rules.reservation_lease_ms, model)
        cost = plan.cost
        later = policies.output_room_needed(buckets, cost)
        charges = admission_plan.admission_charges(buckets, cost)
        if not self._room.ample(charges, rules.bound_headroom, later, share=rules.bound_below):
            return None
        return plan, now, buckets, charges

    def _call(
        self,
        model: AdmitModel,
        plan: AdmissionPlan,
        charging: Charging,
        *,
        on_bound: bool = False,
        at: tuple[int, list[WindowedBucket], list[BucketCharge]] | None = None,
    ) -> _Flow[_Attempt]:
        """The one admission call of ``plan`` (``at``: the time and buckets it was planned
        at and their charges, else now's)."""
        s, rules = self.s, self.rules
        api, tenant, key = s.api, s.tenant, s.key
        assert api is not None and tenant is not None and key is not None
        cost = plan.cost
        charges: list[BucketCharge] | None = None
        if at is None:
            now = self._now_ms()
            listed = s.buckets_at(self._prefix, now, rules.reservation_lease_ms, model)
        else:
            now, listed, charges = at
        buckets = tuple(listed)
        lease = policies.lease_ms(
            settle_to_actual=cost.settle_to_actual,
            holds_slots=any(b.kind == "concurrency" for b in buckets),
            records=self._records,
            lease=rules.reservation_lease_ms,
        )
        draft = draft_record(s, model, cost, now) if lease and self._records else None
        count_refused = policies.counts_refusal(
            on_bound=on_bound, configured=rules.count_refused_requests
        )
        rule = rules.plan_waits.get(tenant.plan)
        queue: QueueCall | None = None
        if rule is not None:
            if not self._arrival:
                self._arrival = now
            queue = QueueCall(
                queue_keys(tenant_tag(self._prefix, tenant.slot), tenant.slot),
                priority_offset_ms(rule.priority_for(s.priority_asked), rule.boost_ms),
                self._arrival + rule.max_ms,
                bucket_kinds(listed),
                cap=rule.max_waiters,
            )
        call = admission_call(
            self.rules,
            listed,
            cost,
            charges=charges,
            now_ms=now,
            lease_until_ms=now + lease if lease else 0,
            draft=draft,
            count_refused=count_refused,
            queue=queue,
        )
        res = self._answer(call, (yield call))
        declined = False
        waits = 0
        while res is not None and res.wait and queue is not None:
            # a ticket until its turn: sleep, then ask again in the windows of then
            ev = yield Wait(res.turn_ms, s.ledger, queue.keys, first=waits == 0)
            waits += 1
            if isinstance(ev, WaitDeclined):
                self._out.append(LeaveQueue(s.ledger, queue.keys))
                declined = True
                break
            if not isinstance(ev, TurnCame):
                raise PhaseError(f"admission waited for its turn, got {ev!r}")
            now = self._now_ms()
            listed = s.buckets_at(self._prefix, now, rules.reservation_lease_ms, model)
            buckets = tuple(listed)
            queue = replace(queue, buckets=bucket_kinds(listed))
            draft = draft_record(s, model, cost, now) if lease and self._records else None
            call = admission_call(
                self.rules,
                listed,
                cost,
                now_ms=now,
                lease_until_ms=now + lease if lease else 0,
                draft=draft,
                count_refused=count_refused,
                queue=queue,
            )
            res = self._answer(call, (yield call))
        out = _Attempt(plan, charging, buckets, now, res, on_bound=on_bound)
        waited = now - self._arrival if rule is not None else -1
        out.waited_ms = waited
        if res is not None and not res.admitted and not res.duplicate:
            err = admission_plan.refusal(
                list(buckets), res.values, cost, now, tenant=tenant.id, model=model.name
            )
            if queue is not None and (declined or res.turn_ms != 0 or waits):
                err = _wait_refusal(err, res, now, declined=declined, waited=waited)
                how = "replica_full" if declined else "queue_full" if res.queue_full else ""
                if not how:
                    how = "refused" if waits else "unservable"
                self._out.append(WaitOver(how, waited))
            if not on_bound:
                self._out.append(LimitDecisions(((err.metric, "refused"),)))
            out.refused = err
        elif res is not None:
            if waits:
                self._out.append(WaitOver("admitted", waited))
            # A duplicate can only be our own retried call (ledger ids are unique per HTTP
            # request): the first execution charged, so the request is admitted and metered.
            if res.duplicate:
                self._out.append(DuplicateAdmit())
            if lease:
                self._out.append(_KEEP_LEASES)
        return out

    def _admit_rpm_only(self) -> _Flow[None]:
        s = self.s
        tenant, key = s.tenant, s.key
        assert tenant is not None and key is not None
        now = self._now_ms()
        limits = tuple(
            lim for lim in tenant.limits_for(key.name) if lim.metric == "rpm" and lim.model == "*"
        )
        buckets = admission_plan.buckets_for(
            prefix=self._prefix,
            tenant=tenant.slot,
            user=s.end_user,
            key_name=key.name,
            model="*",
            limits=limits,
            now_ms=now,
        )
        if not buckets:
            return
        call = admission_call(
            self.rules,
            buckets,
            admission_plan.RPM_ONLY,
            count_refused=policies.counts_refusal(
                on_bound=False, configured=self.rules.count_refused_requests
            ),
        )
        res = self._answer(call, (yield call))
        if res is not None and not res.admitted and not res.duplicate:
            raise admission_plan.refusal(
                buckets, res.values, admission_plan.RPM_ONLY, now, tenant=tenant.id, model="*"
            )

    def _answer(self, call: CallAdmit, ev: AdmissionEvent | None) -> AdmitAnswered | None:
        """What the limiter's answer to ``call`` means; None: it failed (or could not be asked)
        and the plan fails open."""
        if type(ev) is AdmitAnswered:
            return ev
        charges, ttl = call.charges, call.ledger_ttl_ms
        failure_mode = self.rules.failure_mode_for(self.s.plan)
        if isinstance(ev, AdmitBacklogged):
            # Redis has not taken the settlements of the requests admitted before: admitting
            # more would pile up more (dropping one would lose a correction), so push back.
            unmetered = policies.unmetered_on_backlog(failure_mode)
            self._out.append(PushedBack(unmetered))
            if unmetered:
                return None
            raise LimiterUnavailable(
                "the quota backend (Redis) is behind with settlements; retry shortly"
            )
        if isinstance(ev, AdmitCancelled):
            # The request went away while its call was out: the script may run (or have run)
            # all the same.  The cancel undoes it if it did, or stops it from ever running.
            self._out.append(KeepCancel(undo(charges), ttl))
            raise _Cancelled
        if not isinstance(ev, AdmitFailed):
            raise PhaseError(f"admission waited for the limiter's answer, got {ev!r}")
        # The call may still run once Redis answers (it timed out, it did not fail): keep a
        # cancel that undoes it if it ran, or stops it from ever running.
        unmetered = policies.fails_open(failure_mode)
        self._out.append(AdmitError(unmetered))
        if policies.keeps_cancel(maybe_ran=ev.error.maybe_ran):
            self._out.append(KeepCancel(undo(charges), ttl))
        if unmetered:
            return None
        raise ev.error


def _wait_refusal(
    err: QuotaExceeded, res: AdmitAnswered, now_ms: int, *, declined: bool, waited: int
) -> QuotaExceeded:
    """A waiting request's 429: its ``retry-after`` is the turn it would have needed (when
    one was computed), and the message says why it does not wait."""
    turn = res.turn_ms
    if turn > now_ms:
        err.retry_after_s = (turn - now_ms) / 1000.0
    if declined:
        why = "this gateway replica holds its most waiting requests"
    elif res.queue_full:
        why = "the tenant's queue of waiting requests is full"
    elif turn == NEVER:
        why = "the request alone exceeds the limit"
    elif turn > now_ms:
        why = (
            f"its turn would come in {(turn - now_ms) / 1000.0:.3f}s, beyond the plan's "
            "maximum wait"
        )
    else:
        why = "its maximum wait is over"
    waited_s = f" after waiting {waited / 1000.0:.3f}s" if waited > 0 else ""
    err.message = f"{err.message} Not queued{waited_s}: {why}."
    return err
