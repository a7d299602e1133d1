"""Admission's calls and plans, as functions of the session and the rules: the plan of an
input count (:func:`plan_for`), the plan on an upper bound when admission may decide on one
(:func:`bound_plan`), the limiter call of a cost on some buckets (:func:`admission_call`), the
fallback model of a refusal (:func:`fallback_model`), the usage record's draft
(:func:`draft_record`), what undoes its charges should it run after all (:func:`undo`) and
what the limiter's answer means (:func:`read_answer`) and what an admission that said yes
records and forwards (:func:`admitted`).
The machine that uses them is :mod:`extproc.core.admission_flow`.  Sans-IO."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from extproc.core import admission_plan, policies
from extproc.core.admission_plan import AdmissionPlan, Cost
from extproc.core.admission_rules import AdmissionRules, bound_input
from extproc.core.admission_vocabulary import (
    AdmissionAction,
    AdmitAnswered,
    AdmitBacklogged,
    AdmitError,
    AdmitFailed,
    CallAdmit,
    Decided,
    DraftRecord,
    ForwardBody,
    KeepCancel,
    LimitDecisions,
    PushedBack,
    ShadowRefused,
)
from extproc.core.apis.base import ParsedRequest, RequestLimits
from extproc.core.counters import UTF8BoundCounter
from extproc.core.figures import run_ahead_budget
from extproc.core.keys import WindowedBucket
from extproc.core.phase_records import AdmitModel, Admitted
from extproc.core.room_hints import RoomHints
from extproc.core.rules import Adjustment, BucketCharge, Charging
from extproc.core.session import Session
from extproc.core.waiting import WAITED_HEADER, QueueCall
from extproc.errors import (
    BadRequest,
    LimiterUnavailable,
    QuotaExceeded,
    RequestTooLarge,
    UnknownModel,
)


def parse_body(s: Session, rules: AdmissionRules, raw: bytes) -> tuple[ParsedRequest, AdmitModel]:
    """The request body parsed, with the model it asks for: a body over the size limit, one
    that does not parse and an unknown model (unless the rules estimate it) are the client's
    errors, raised."""
    api = s.api
    assert api is not None
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
                f"The model '{req.model[:100]}' does not exist or you do not have access to it.",
                status=rules.unknown_model_status,
            )
        model = rules.unknown_model
    return req, model


def rpm_buckets(s: Session, *, prefix: str, now_ms: int) -> list[WindowedBucket]:
    """The tenant-wide RPM buckets an ``rpm_only`` path's request counts on (none: it
    passes)."""
    tenant, key = s.tenant, s.key
    assert tenant is not None and key is not None
    limits = tuple(
        lim for lim in tenant.limits_for(key.name) if lim.metric == "rpm" and lim.model == "*"
    )
    return admission_plan.buckets_for(
        prefix=prefix,
        tenant=tenant.slot,
        user=s.end_user,
        key_name=key.name,
        model="*",
        limits=limits,
        now_ms=now_ms,
    )


def plan_for(
    s: Session, rules: AdmissionRules, model: AdmitModel, charging: Charging, input_tokens: int
) -> AdmissionPlan:
    """The admission plan of ``input_tokens`` (raises the client's 400/413 on limits)."""
    req, api = s.req, s.api
    assert req is not None and api is not None
    return admission_plan.plan_admission(
        declared_max_output=req.declared_max_output,
        sequences=req.sequences,
        stream=req.stream and api.can_stream,
        input_tokens=input_tokens,
        model_name=model.name,
        model_cap=model.max_output_tokens,
        max_input_tokens=model.max_input_tokens,
        over_cap=rules.over_model_cap,
        budget_param=req.budget_fields[0] if req.budget_fields else "max_tokens",
        charging=charging,
        exact_json=(
            not req.stream and api.can_stream and model.exact_non_streams and api.reassembles(req)
        ),
    )


def admission_call(
    rules: AdmissionRules,
    buckets: list[WindowedBucket],
    cost: Cost,
    *,
    count_refused: bool,
    now_ms: int = 0,
    lease_until_ms: int = 0,
    draft: DraftRecord | None = None,
    charges: list[BucketCharge] | None = None,
    queue: QueueCall | None = None,
) -> CallAdmit:
    """The admission call of ``cost`` on ``buckets`` (``charges``: their admission charges of
    ``cost`` when already made); the flow reads its answer."""
    return CallAdmit(
        tuple(buckets),
        admission_plan.admission_charges(buckets, cost) if charges is None else charges,
        cost.tpm_amount,
        count_refused,
        rules.ledger_ttl_seconds * 1000,
        now_ms=now_ms,
        lease_until_ms=lease_until_ms,
        draft=draft,
        queue=queue,
    )


@dataclass(slots=True)
class Asked:
    """The admission call out, with what it was planned on (its answer is read against it)."""

    call: CallAdmit
    plan: AdmissionPlan | None  # None: an rpm_only path's call
    buckets: tuple[WindowedBucket, ...]
    now: int
    leased: bool
    on_bound: bool = False
    queue: QueueCall | None = None  # the plan waits (docs/semantics.md, "Waiting")


def ask_call(  # noqa: PLR0917 - the call's whole plan
    s: Session,
    rules: AdmissionRules,
    model: AdmitModel,
    plan: AdmissionPlan,
    listed: list[WindowedBucket],
    now: int,
    charges: list[BucketCharge] | None,
    records: bool,
    on_bound: bool,
    queue: QueueCall | None,
) -> Asked:
    """The one admission call of ``plan`` on ``listed`` at ``now`` (``charges``: theirs when
    already made; ``records``: usage records are written, a lease keeps a draft)."""
    cost = plan.cost
    lease = policies.lease_ms(
        settle_to_actual=cost.settle_to_actual,
        holds_slots=any(b.kind == "concurrency" for b in listed),
        records=records,
        lease=rules.reservation_lease_ms,
    )
    call = admission_call(
        rules,
        listed,
        cost,
        charges=charges,
        now_ms=now,
        lease_until_ms=now + lease if lease else 0,
        draft=draft_record(s, model, cost, now) if lease and records else None,
        count_refused=policies.counts_refusal(
            on_bound=on_bound, configured=rules.count_refused_requests
        ),
        queue=queue,
    )
    return Asked(call, plan, tuple(listed), now, bool(lease), on_bound, queue)


def refusal_of(s: Session, asked: Asked, res: AdmitAnswered, model: str) -> QuotaExceeded:
    """The 429 of a refused call (``model``: the model it was asked as, ``*`` for an
    rpm_only path's)."""
    tenant = s.tenant
    assert tenant is not None
    cost = asked.plan.cost if asked.plan is not None else admission_plan.RPM_ONLY
    return admission_plan.refusal(
        list(asked.buckets), res.values, cost, asked.now, tenant=tenant.id, model=model
    )


def fallback_model(
    s: Session,
    rules: AdmissionRules,
    model: AdmitModel,
    *,
    buckets: tuple[WindowedBucket, ...],
    answer: AdmitAnswered | None,
    cost: Cost,
) -> AdmitModel | None:
    """The plan's fallback model for a refusal by a limit on ``model``
    (:func:`extproc.core.policies.fallback_for`), given the refused call's ``answer``."""
    tenant = s.tenant
    assert tenant is not None and answer is not None
    name = policies.fallback_for(
        rules.fallbacks,
        tenant=tenant,
        model=model,
        buckets=buckets,
        values=answer.values,
        cost=cost,
    )
    return rules.models.get(name) if name is not None else None


def draft_record(s: Session, model: AdmitModel, cost: Cost, now_ms: int) -> DraftRecord:
    """The usage record's draft a leased admission leaves in the ledger (written by the
    tenant's next admission if this processor dies)."""
    api, tenant, key = s.api, s.tenant, s.key
    assert api is not None and tenant is not None and key is not None
    return DraftRecord(
        request_id=s.request_id,
        tenant=tenant.id,
        key=key.name,
        model=model.name,
        api=api.name,
        input_tokens=cost.input_tokens,
        reserved_output=cost.reserved_output if cost.settle_to_actual else 0,
        admitted_at_ms=now_ms,
    )


def undo(charges: list[BucketCharge]) -> list[Adjustment]:
    """What undoes an admission's charges if its call ran (concurrency slots aside: the
    ledger frees them)."""
    return [
        Adjustment(c.key, -c.amount, c.expire_at_ms)
        for c in charges
        if c.kind != "concurrency" and c.amount
    ]


def bound_plan(
    s: Session,
    rules: AdmissionRules,
    model: AdmitModel,
    charging: Charging,
    *,
    prefix: str,
    room: RoomHints,
    now_ms: Callable[[], int],
) -> tuple[AdmissionPlan, int, list[WindowedBucket], list[BucketCharge]] | None:
    """The plan on an upper bound of the input, when admission may decide on it: the
    model's tokenizer has a proven bound, the bound is within the model's input limit, the
    request settles to its actual figures (a final-at-admission charge would keep the
    bound), and every per-token counter was last seen (``room``) with ``bound_headroom`` times
    the charge free (and, for a metered stream, its whole output besides); with the time and
    buckets it was judged at and their charges (the call's own: made once)."""
    api, req = s.api, s.req
    assert api is not None and req is not None
    if not policies.may_admit_on_bound(
        enabled=rules.admit_on_bound, proven_bound=model.bound_counter is not None
    ):
        return None
    bound = bound_input(api, req, model)
    if bound is None or not policies.bound_within(bound, model.max_input_tokens):
        return None
    plan = plan_for(s, rules, model, charging, bound)
    if not plan.cost.settle_to_actual:
        return None
    now = now_ms()
    buckets = s.buckets_at(prefix, now, rules.reservation_lease_ms, model)
    cost = plan.cost
    later = policies.output_room_needed(buckets, cost)
    charges = admission_plan.admission_charges(buckets, cost)
    if not room.ample(charges, rules.bound_headroom, later, share=rules.bound_below):
        return None
    return plan, now, buckets, charges


def admitted(
    s: Session,
    rules: AdmissionRules,
    served: AdmitModel,
    plan: AdmissionPlan,
    charging: Charging,
    *,
    buckets: tuple[WindowedBucket, ...],
    now_ms: int,
    res: AdmitAnswered | None,
    headers: tuple[tuple[str, str], ...],
    on_bound: bool,
    out: list[AdmissionAction],
    waited_ms: int = -1,
) -> None:
    """Admission said yes as ``served`` (``res`` None: unmetered, the plan failed open): the
    admitted record goes to the session; the shadow report, the decision and the body to
    forward (last) go to ``out``.  ``waited_ms``: how long it waited for its turn (-1: its
    plan does not wait; else it is told in ``x-ratelimit-waited-ms``)."""
    api, tenant, key, req = s.api, s.tenant, s.key, s.req
    assert api is not None and tenant is not None and key is not None and req is not None
    cost = plan.cost if res is not None else None
    budget = plan.budget
    if res is not None:
        budget = run_ahead_budget(
            budget, buckets=buckets, values=res.values, cost=plan.cost, sequences=req.sequences
        )
        headers += tuple(
            admission_plan.rate_limit_headers(list(buckets), res.values, now_ms).as_pairs()
        )
        shadow = policies.shadow_outcome(buckets, res.values, plan.cost)
        out.append(LimitDecisions(shadow.decisions))
        if shadow.exceeded:
            out.append(ShadowRefused(shadow.exceeded))
        headers += shadow.headers()
    if waited_ms >= 0:
        headers += ((WAITED_HEADER, str(waited_ms)),)
    floor = 0
    if on_bound and isinstance(served.bound_counter, UTF8BoundCounter):
        floor = served.bound_counter.fewest_tokens(plan.cost.input_tokens)
    s.admit(
        Admitted(
            served,
            cost,
            buckets,
            now_ms,
            headers,
            input_bound=on_bound,
            input_floor=floor,
            waited_ms=max(0, waited_ms),
        ),
        admission_plan.admission_usage(cost) if cost is not None else None,
    )
    out.append(
        Decided(
            tenant=tenant.id,
            key=key.name,
            model=served.name,
            api=api.name,
            input_tokens=plan.cost.input_tokens,
            input_counted="after" if on_bound else "before",
            reserved_output=plan.cost.reserved_output,
            stream=req.stream,
            decision="admitted" if res is not None else "admitted_unmetered",
            mode=charging.mode,
            streaming=charging.streaming,
        )
    )
    out.append(
        ForwardBody(
            api.rewrite(
                req,
                budget=budget,
                force_usage=rules.force_include_usage and plan.cost.meter_stream,
                model=served.name if served.known else None,
                continuous_usage=served.continuous_usage and plan.cost.meter_stream,
                # admitted unmetered (fail-open): nothing meters the response, so it goes as
                # the client sent it
                upstream_stream=plan.cost.upstream_stream and res is not None,
                stream_interval=served.exact_stream_interval,
            )
        )
    )


def read_answer(
    rules: AdmissionRules,
    plan: str,
    call: CallAdmit,
    ev: AdmitAnswered | AdmitFailed | AdmitBacklogged,
    out: list[AdmissionAction],
) -> AdmitAnswered | None:
    """What the limiter's answer to ``call`` means (its notes go to ``out``); None: it failed
    (or could not be asked) and ``plan``'s failure mode fails open; failing closed raises."""
    if type(ev) is AdmitAnswered:
        return ev
    failure_mode = rules.failure_mode_for(plan)
    if isinstance(ev, AdmitBacklogged):
        # Redis has not taken the settlements of the requests admitted before: admitting
        # more would pile up more (dropping one would lose a correction), so push back.
        unmetered = policies.unmetered_on_backlog(failure_mode)
        out.append(PushedBack(unmetered))
        if unmetered:
            return None
        raise LimiterUnavailable(
            "the quota backend (Redis) is behind with settlements; retry shortly"
        )
    assert isinstance(ev, AdmitFailed)
    # The call may still run once Redis answers (it timed out, it did not fail): keep a
    # cancel that undoes it if it ran, or stops it from ever running.
    unmetered = policies.fails_open(failure_mode)
    out.append(AdmitError(unmetered))
    if policies.keeps_cancel(maybe_ran=ev.error.maybe_ran):
        out.append(KeepCancel(undo(call.charges), call.ledger_ttl_ms))
    if unmetered:
        return None
    raise ev.error
