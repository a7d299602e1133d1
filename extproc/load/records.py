"""Per-request records collected by the load harness, joined with the simulator's ground truth
(its own :class:`~extproc.sim.records.SimRecord` schema, read back from ``GET /sim/requests``)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from extproc.sim.records import SimRecord

Outcome = Literal["ok", "refused", "cut", "failed"]
OUTCOMES: tuple[Outcome, ...] = ("ok", "refused", "cut", "failed")

RATE_LIMIT_HEADERS: tuple[str, ...] = (
    "retry-after",
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)


@dataclass
class RequestRecord:
    """Everything the client observed about one request.

    Times: ``start_wall`` is a ``time.time()`` float; ``delta_offsets`` are seconds after the
    start (measured with a monotonic clock) of each content-bearing event, and ``delta_tokens``
    the client-side token count of that event's content.
    """

    n: int
    request_id: str
    tenant: str
    model: str
    stream: bool
    target: str
    start_wall: float
    max_tokens: int
    prompt_tokens_estimate: int
    status: int | None = None
    outcome: Outcome = "failed"
    reason: str | None = None
    error_code: str | None = None
    error_type: str | None = None
    duration: float | None = None
    ttft: float | None = None
    delta_offsets: list[float] = field(default_factory=list)
    delta_tokens: list[int] = field(default_factory=list)
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    saw_done: bool = False
    upstream_tokens: int | None = None
    upstream_ending: str | None = None
    upstream_first_token_at: float | None = None
    upstream_last_token_at: float | None = None

    @property
    def output_tokens_client(self) -> int:
        """Output tokens counted by the client (cl100k on each content delta)."""
        return sum(self.delta_tokens)

    @property
    def admitted(self) -> bool:
        """True when the request was admitted and ended normally or by a quota cut."""
        return self.outcome in ("ok", "cut")

    @property
    def charged(self) -> bool:
        """True when the upstream answered 2xx, so the prompt was charged against the quota."""
        return self.status is not None and 200 <= self.status < 300

    def inter_token_latencies(self) -> list[float]:
        """Seconds between consecutive content-bearing events."""
        offs = self.delta_offsets
        return [b - a for a, b in itertools.pairwise(offs)]

    def to_json(self) -> dict[str, Any]:
        """Serialisable form used for ``requests.jsonl``."""
        return {
            "n": self.n,
            "request_id": self.request_id,
            "tenant": self.tenant,
            "model": self.model,
            "stream": self.stream,
            "target": self.target,
            "start": self.start_wall,
            "max_tokens": self.max_tokens,
            "status": self.status,
            "outcome": self.outcome,
            "reason": self.reason,
            "error_code": self.error_code,
            "error_type": self.error_type,
            "duration_s": self.duration,
            "ttft_s": self.ttft,
            "output_tokens_client": self.output_tokens_client,
            "content_events": len(self.delta_tokens),
            "usage_prompt_tokens": self.usage_prompt_tokens,
            "usage_completion_tokens": self.usage_completion_tokens,
            "prompt_tokens_estimate": self.prompt_tokens_estimate,
            "headers": self.headers,
            "saw_done": self.saw_done,
            "upstream_tokens": self.upstream_tokens,
            "upstream_ending": self.upstream_ending,
        }


_SIM_FIELDS = frozenset(f.name for f in fields(SimRecord))


def sim_record_from_json(raw: Mapping[str, Any]) -> SimRecord | None:
    """One record of the simulator's ``GET /sim/requests`` (its ``SimRecord.to_dict()``) as a
    :class:`~extproc.sim.records.SimRecord`; ``None`` without a ``client_request_id`` (not a
    request of ours). Keys the simulator's schema does not have are ignored."""
    rid = raw.get("client_request_id")
    if not isinstance(rid, str) or not rid:
        return None
    known = {k: v for k, v in raw.items() if k in _SIM_FIELDS}
    known.setdefault("sim_id", "")
    known.setdefault("path", "")
    known.setdefault("started_at", 0.0)
    return SimRecord(**known)


def join_ground_truth(records: list[RequestRecord], sim: list[SimRecord]) -> dict[str, Any]:
    """Attach simulator ground truth to client records (by request id); return join stats."""
    by_id = {s.client_request_id: s for s in sim}
    matched = 0
    endings: dict[str, int] = {}
    seen: set[str] = set()
    for rec in records:
        s = by_id.get(rec.request_id)
        if s is None:
            continue
        matched += 1
        seen.add(rec.request_id)
        rec.upstream_tokens = s.tokens_sent
        rec.upstream_ending = s.ending
        rec.upstream_first_token_at = s.first_token_at
        rec.upstream_last_token_at = s.last_token_at
        endings[s.ending] = endings.get(s.ending, 0) + 1
    return {
        "matched": matched,
        "client_without_upstream": len(records) - matched,
        "upstream_without_client": sum(1 for s in sim if s.client_request_id not in seen),
        "endings": dict(sorted(endings.items())),
    }
