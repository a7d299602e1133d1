"""One request's data as the phases fill it in (its *state* lives in the lifecycle)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from extproc.config.runtime import ApiKey, Model, RuntimeConfig, Tenant
from extproc.core.account import RequestAccount
from extproc.core.admission import Cost
from extproc.core.apis.base import ApiFormat, ParsedRequest
from extproc.core.keys import WindowedBucket
from extproc.core.lifecycle import Lifecycle
from extproc.core.rules import UnconfirmedCharge


@dataclass(slots=True)
class RequestContext:
    """Identity, request, cost and charges of one HTTP request."""

    cfg: RuntimeConfig
    started: float = field(default_factory=time.perf_counter)
    request_id: str = ""
    path: str = ""
    api: ApiFormat | None = None
    key: ApiKey | None = None
    tenant: Tenant | None = None
    model: Model | None = None
    req: ParsedRequest | None = None
    cost: Cost | None = None  # set only once admitted and metered
    admitted_at_ms: int = 0
    buckets: list[WindowedBucket] = field(default_factory=list)
    ledger: str = ""
    account: RequestAccount = field(default_factory=RequestAccount)
    headers_out: list[tuple[str, str]] = field(default_factory=list)
    status: int | None = None
    usage_output: int | None = None  # a JSON response's usage, within bounds
    usage_input: int | None = None  # the upstream's input figure (used for unseen input only)
    usage_cached_input: int = 0  # from the upstream's usage, when it says
    usage_reasoning: int = 0
    # the last stream charge whose answer never came (settlement undoes it if it ran)
    unconfirmed: UnconfirmedCharge | None = None

    @property
    def metered(self) -> bool:
        """Admitted with counters to settle (not refused, not fail-open, not unmetered)."""
        return self.cost is not None

    @property
    def holds_slots(self) -> bool:
        """Whether the request takes concurrency slots (freed at settlement)."""
        return any(b.kind == "concurrency" for b in self.buckets)

    @property
    def slots(self) -> list[str]:
        """The concurrency sets holding this request."""
        return [b.key for b in self.buckets if b.kind == "concurrency"]

    @property
    def plan(self) -> str:
        """The tenant's plan name ('' before identification)."""
        return self.tenant.plan if self.tenant else ""

    def latency_ms(self) -> float:
        """Milliseconds since the request headers arrived."""
        return round((time.perf_counter() - self.started) * 1000, 3)


def metadata(
    ctx: RequestContext, life: Lifecycle, *, output_tokens: int | None = None
) -> dict[str, Any]:
    """The ``ai_quota`` dynamic metadata the access log prints."""
    ending = life.ending
    out: dict[str, Any] = {
        "tenant": ctx.tenant.id if ctx.tenant else "",
        "key": ctx.key.name if ctx.key else "",
        "model": ctx.model.name if ctx.model else "",
        "api": ctx.api.name if ctx.api else "",
        "input_tokens": ctx.cost.input_tokens if ctx.cost else 0,
        "ending": ending.value if ending else "in_progress",
    }
    if output_tokens is not None:
        out["output_tokens"] = output_tokens
    return out
