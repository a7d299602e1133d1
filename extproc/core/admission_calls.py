"""Admission's calls and plans, as functions of the session and the rules: the plan of an
input count (:func:`plan_for`), the limiter call of a cost on some buckets
(:func:`admission_call`), the fallback model of a refusal (:func:`fallback_model`), the usage
record's draft (:func:`draft_record`) and what undoes its
charges should it run after all (:func:`undo`).
The flow that uses them is :mod:`extproc.core.admission_flow`.  Sans-IO."""

from __future__ import annotations

from extproc.core import admission_plan, policies
from extproc.core.actions import CallAdmit, DraftRecord
from extproc.core.admission_plan import AdmissionPlan, Cost
from extproc.core.admission_rules import AdmissionRules
from extproc.core.events import AdmitAnswered
from extproc.core.keys import WindowedBucket
from extproc.core.phase_records import AdmitModel
from extproc.core.rules import Adjustment, BucketCharge, Charging
from extproc.core.session import Session
from extproc.core.waiting import QueueCall


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
