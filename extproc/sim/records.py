"""Ground-truth records kept by the simulator: one per generation request, in a ring buffer."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

ENDINGS: tuple[str, ...] = (
    "in_progress",
    "completed",
    "client_disconnected",
    "injected_disconnect",
    "error_status",
)


@dataclass(slots=True)
class SimRecord:
    """What one request asked for and what the simulator actually did with it."""

    sim_id: str
    path: str
    started_at: float
    request_id: str | None = None
    client_request_id: str | None = None
    tenant: str | None = None
    model: str | None = None
    stream: bool = False
    n: int = 1
    max_tokens: int | None = None
    prompt_tokens: int = 0
    #: the prompt-token count the usage reports (differs from prompt_tokens under
    #: x-sim-prompt-usage, an upstream that under-reports its input)
    prompt_tokens_reported: int = 0
    tokens_planned: int = 0
    tokens_sent: int = 0
    ending: str = "in_progress"
    status: int | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    ended_at: float | None = None
    disconnected_at: float | None = None
    include_usage: bool = False
    headers_seen: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    #: which API: chat | completions | responses | messages | embeddings
    api: str | None = None
    #: the output budget as written in the request body (None = the request had none)
    max_tokens_seen: int | None = None
    #: completions: prompts in the batch; choices = prompts x n
    prompts: int = 1
    choices: int = 1
    #: output-token count the simulator put in the usage it sent (None = no usage sent)
    usage_reported: int | None = None
    #: the x-sim-usage header when usage was falsified, else None
    usage_lie: str | None = None
    #: "gzip" when the body was gzip-encoded, else None
    content_encoding: str | None = None
    #: the Content-Type header value sent (None = no header)
    content_type: str | None = None
    #: the Content-Length header sent on a streamed body, else None
    content_length: int | None = None
    #: tokens per streamed event (before trigger/reasoning boundaries shorten a chunk)
    chunk_tokens: int = 1
    #: whether the stream was sent in one write (x-sim-burst-tokens)
    burst: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready copy of the record."""
        return asdict(self)

    @property
    def finished(self) -> bool:
        """True once the ending is final."""
        return self.ending != "in_progress"


class RecordStore:
    """Ring buffer of the newest ``max_records`` records plus running totals."""

    def __init__(self, max_records: int) -> None:
        self._max = max_records
        self._records: OrderedDict[str, SimRecord] = OrderedDict()
        self._ids = itertools.count(1)
        self.total_requests = 0
        self.total_tokens_sent = 0
        self.in_progress = 0

    def new(self, path: str, started_at: float) -> SimRecord:
        """Create, store and return a fresh in-progress record."""
        rec = SimRecord(sim_id=f"sim-{next(self._ids):08d}", path=path, started_at=started_at)
        self._records[rec.sim_id] = rec
        while len(self._records) > self._max:
            self._records.popitem(last=False)
        self.total_requests += 1
        self.in_progress += 1
        return rec

    def add_tokens(self, rec: SimRecord, tokens: int, now: float) -> None:
        """Account ``tokens`` output tokens as written to the socket at ``now``."""
        if tokens <= 0:
            return
        rec.tokens_sent += tokens
        self.total_tokens_sent += tokens
        if rec.first_token_at is None:
            rec.first_token_at = now
        rec.last_token_at = now

    def finish(self, rec: SimRecord, ending: str, now: float) -> bool:
        """Set the final ending once; returns False if the record had already ended."""
        if rec.finished:
            return False
        rec.ending = ending
        rec.ended_at = now
        self.in_progress -= 1
        return True

    def get(self, sim_id: str) -> SimRecord | None:
        """Record by id, if still in the buffer."""
        return self._records.get(sim_id)

    def list(self, client_request_id: str | None = None) -> list[SimRecord]:
        """Records oldest first, optionally only those with the given client request id."""
        if client_request_id is None:
            return list(self._records.values())
        return [r for r in self._records.values() if r.client_request_id == client_request_id]

    def clear(self) -> None:
        """Drop all buffered records (totals are kept)."""
        self._records.clear()

    def stats(self) -> dict[str, int]:
        """Running totals since start-up."""
        return {
            "requests": self.total_requests,
            "tokens_sent": self.total_tokens_sent,
            "in_progress": self.in_progress,
            "buffered_records": len(self._records),
        }
