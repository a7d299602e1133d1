"""What a settled request's span and metrics say, from the session's phase records (pure: no
OpenTelemetry import).  Names follow the OpenTelemetry GenAI semantic conventions where one
exists (``gen_ai.*``, ``error.type``, ``http.response.status_code``); the gateway's own facts
are under ``ai_quota.*`` (docs/observability.md lists each).

Nothing here carries client text: models are the configuration's names, the key is its
*name* (never the secret), limits are described by their rule (metric, window, scope, model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal

from extproc.core.lifecycle import Ending
from extproc.core.rules import Limit
from extproc.core.session import Session
from extproc.errors import GatewayError, QuotaExceeded, StreamCut

AttrValue = str | bool | int | float | list[str]
Attrs = dict[str, AttrValue]

#: ``gen_ai.operation.name`` of each API the gateway meters.
OPERATIONS = {
    "chat": "chat",
    "completions": "text_completion",
    "responses": "chat",
    "messages": "chat",
    "embeddings": "embeddings",
}
#: ``gen_ai.provider.name``: whose API shape the request speaks (the engine behind may differ).
PROVIDERS = {"messages": "anthropic"}
DEFAULT_PROVIDER = "openai"


def limit_label(limit: Limit) -> str:
    """A limit as its rule reads: ``tpm/minute/tenant/*``, ``concurrency/key/gpt-4o``
    (``/shadow`` appended for a shadow limit).  Bounded: it names configuration only."""
    window = "" if limit.metric == "concurrency" else f"/{limit.period_name}"
    tail = "/shadow" if limit.shadow else ""
    return f"{limit.metric}{window}/{limit.scope}/{limit.model}{tail}"


def limit_attrs(prefix: str, limit: Limit) -> Attrs:
    """The attributes naming one limit (which metric, window, level and model)."""
    out: Attrs = {
        f"{prefix}.metric": limit.metric,
        f"{prefix}.scope": limit.scope,
        f"{prefix}.model": limit.model,
        f"{prefix}.value": limit.limit,
        f"{prefix}.rule": limit_label(limit),
    }
    if limit.metric != "concurrency":
        out[f"{prefix}.window"] = limit.period_name
    if limit.owner:  # a level's limit: its organisation or team (docs/semantics.md, "Levels")
        out[f"{prefix}.owner"] = limit.owner
    return out


@dataclass(slots=True)
class Observed:
    """What the server told the trace beyond the phase records: the error the request was
    answered with, the cut, the mid-stream charges, the moments (ns since the epoch)."""

    error: GatewayError | None = None
    cut_reason: str = ""
    cut_delivered: int = 0
    cut_charged: int = 0
    cut_error: StreamCut | None = None
    charges: int = 0
    charged_tokens: int = 0
    charge_failures: int = 0
    marks: dict[str, int] = field(default_factory=dict)


def decision(s: Session, seen: Observed) -> str:
    """``admitted``, ``refused`` (a 429 at admission), ``rejected`` (any other answer of the
    gateway), ``fail_open`` (admitted unmetered: the limiter was unavailable and the plan lets
    requests through) or ``passthrough`` (an unmetered path)."""
    err = seen.error
    if err is not None and s.admitted is None:
        return "refused" if err.status == 429 else "rejected"
    adm = s.admitted
    if adm is not None:
        return "fail_open" if adm.cost is None else "admitted"
    if s.ending is Ending.PASSTHROUGH:
        return "passthrough"
    return "rejected" if err is not None else "none"


def model_attrs(s: Session) -> Attrs:
    """The bounded GenAI attributes a request's metrics share (configuration names only)."""
    api = s.api
    name = api.name if api is not None else ""
    out: Attrs = {
        "gen_ai.operation.name": OPERATIONS.get(name, name or "unknown"),
        "gen_ai.provider.name": PROVIDERS.get(name, DEFAULT_PROVIDER),
    }
    parsed = s.parsed
    if parsed is not None and parsed.model.known:
        out["gen_ai.request.model"] = parsed.model.name
    model = s.model
    if model is not None and model.known and s.admitted is not None:
        out["gen_ai.response.model"] = model.name
    return out


@dataclass(frozen=True, slots=True)
class Bill:
    """The settled request's figures as its usage record bills them."""

    input: int
    output: int
    cached_input: int
    reasoning: int
    charged: int  # what admission and the stream's charges held before settlement
    settled: int  # what the counters hold after it
    money: Decimal | None
    currency: str


def bill(s: Session) -> Bill | None:
    """What the request was billed (the figures its usage record carries), or None when it
    was not settled against the limiter (refused, unmetered, fail-open)."""
    result = s.settled
    cost, model = s.cost, s.model
    if result is None or cost is None:
        return None
    charged = s.account.total
    total = result.total  # the plan's (what the counters hold once settled)
    priced = model is not None and model.prices is not None and bool(model.currency)
    b = result.billed(cost.requests, model.prices if priced and model is not None else None)
    rep = s.reported
    return Bill(
        input=b.input,
        output=b.output,
        cached_input=rep.cached_input if rep else 0,
        reasoning=rep.reasoning if rep else 0,
        charged=charged,
        settled=total,
        money=b.money,
        currency=model.currency if b.money is not None and model is not None else "",
    )


def span_name(s: Session) -> str:
    """``{gen_ai.operation.name} {gen_ai.request.model}`` (the convention), the operation alone
    before the model is known; ``ai_quota passthrough`` for an unmetered path."""
    if s.api is None or (s.ending is Ending.PASSTHROUGH and s.admitted is None):
        return "ai_quota passthrough"
    base = model_attrs(s)
    op = str(base["gen_ai.operation.name"])
    model = base.get("gen_ai.request.model")
    return f"{op} {model}" if model else op


def span_attrs(s: Session, seen: Observed, b: Bill | None) -> Attrs:
    """Every attribute of the request's span."""
    out = model_attrs(s)
    out["ai_quota.request_id"] = s.request_id
    out["ai_quota.decision"] = decision(s, seen)
    ending = s.ending
    if ending is not None:
        out["ai_quota.ending"] = ending.value
    if s.status is not None:
        out["http.response.status_code"] = s.status
    if s.tenant is not None:
        out["ai_quota.tenant.id"] = s.tenant.id
        out["ai_quota.plan"] = s.tenant.plan
    if s.key is not None:
        out["ai_quota.key.name"] = s.key.name  # the key's name: its text is never kept
    if s.tenant is not None and s.tenant.organisation:  # its levels (config ids, never users)
        out["ai_quota.organisation"] = s.tenant.organisation
        team = s.tenant.team_of(s.key.name if s.key is not None else "")
        if team:
            out["ai_quota.team"] = team
    if s.api is not None:
        out["ai_quota.api"] = s.api.name
    parsed = s.parsed
    if parsed is not None:
        out["gen_ai.request.stream"] = parsed.req.stream
        if parsed.req.declared_max_output is not None:
            out["gen_ai.request.max_tokens"] = parsed.req.declared_max_output
        if parsed.req.sequences != 1:
            out["gen_ai.request.choice.count"] = parsed.req.sequences
    adm = s.admitted
    if adm is not None:
        if adm.buckets:
            out["ai_quota.limits"] = sorted({limit_label(bk.limit) for bk in adm.buckets})
        if adm.cost is not None:
            out["ai_quota.admission.input_tokens"] = adm.cost.input_tokens
            out["ai_quota.admission.input_bound"] = adm.input_bound
            out["ai_quota.admission.reserved_output_tokens"] = adm.cost.reserved_output
            out["ai_quota.admission.charged_tokens"] = adm.cost.tpm_amount
            out["ai_quota.stream.enforced"] = adm.cost.enforce_stream
    err = seen.error
    if err is not None:
        out["error.type"] = err.code
        if isinstance(err, QuotaExceeded):
            out["ai_quota.refused.metric"] = err.metric
            if err.limit is not None:
                out.update(limit_attrs("ai_quota.refused.limit", err.limit))
    if seen.cut_reason:
        out["ai_quota.cut.reason"] = seen.cut_reason
        out["ai_quota.cut.delivered_tokens"] = seen.cut_delivered
        out["ai_quota.cut.charged_tokens"] = seen.cut_charged
        cut = seen.cut_error
        if cut is not None:
            out["error.type"] = cut.code
            if cut.limit is not None:
                out.update(limit_attrs("ai_quota.cut.limit", cut.limit))
    if seen.charges:
        out["ai_quota.stream.charges"] = seen.charges
        out["ai_quota.stream.charged_tokens"] = seen.charged_tokens
    if seen.charge_failures:
        out["ai_quota.stream.charge_failures"] = seen.charge_failures
    if "stream_unmetered" in seen.marks:
        out["ai_quota.stream.fail_open"] = True
    if b is not None:
        out["gen_ai.usage.input_tokens"] = b.input
        out["gen_ai.usage.output_tokens"] = b.output
        if b.cached_input:
            out["gen_ai.usage.cache_read.input_tokens"] = b.cached_input
        if b.reasoning:
            out["ai_quota.usage.reasoning_tokens"] = b.reasoning
        out["ai_quota.settlement.charged_tokens"] = b.charged
        out["ai_quota.settlement.billed_tokens"] = b.settled
        out["ai_quota.settlement.refunded_tokens"] = max(0, b.charged - b.settled)
        out["ai_quota.settlement.added_tokens"] = max(0, b.settled - b.charged)
        if b.money is not None:
            out["ai_quota.cost"] = float(b.money)
            out["ai_quota.cost.currency"] = b.currency
    marks = seen.marks
    t0 = marks.get("open", 0)
    if "admitted" in marks and t0:
        out["ai_quota.admission.duration_ms"] = round((marks["admitted"] - t0) / 1e6, 3)
    if "first_chunk" in marks and t0:
        out["ai_quota.time_to_first_chunk_ms"] = round((marks["first_chunk"] - t0) / 1e6, 3)
    return out
