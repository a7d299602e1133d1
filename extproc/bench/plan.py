"""What one benchmark run measures (:class:`BenchPlan`) and what it fills in (:class:`Bench`)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.bench.report import Table


@dataclass(frozen=True)
class BenchPlan:
    """How much to measure (``quick`` shrinks every count)."""

    rounds: int = 5
    admit_c1: int = 200
    admit_c16: int = 800
    #: non-streaming requests per arm and round of the direct per-request CPU measurement
    fixed_requests: int = 400
    fixed_concurrency: int = 4
    short_streams_lat: int = 8
    long_streams_lat: int = 2
    cpu_streams: int = 16
    cpu_concurrency: int = 4
    tok_e2e: int = 20
    acc_concurrency: int = 64
    acc_limit: int = 20_000
    every: int = 64
    worker_rounds: int = 3
    worker_seconds: float = 2.5
    worker_concurrency: int = 32
    profile_seconds: float = 5.0
    soak_seconds: float = 60.0
    #: the peer section (LiteLLM): non-streaming requests per arm and round at c=1 and c=16,
    #: 200-token streams per arm and round at c=16, the enforcement runs' clients and seconds
    peer_c1: int = 200
    peer_c16: int = 640
    peer_streams: int = 32
    peer_clients: int = 4
    peer_enforce_s: float = 12.0

    @classmethod
    def quick(cls) -> BenchPlan:
        """About one minute in all."""
        return cls(
            rounds=3,
            admit_c1=60,
            admit_c16=240,
            fixed_requests=120,
            short_streams_lat=4,
            long_streams_lat=1,
            cpu_streams=8,
            tok_e2e=8,
            worker_rounds=2,
            worker_seconds=1.5,
            profile_seconds=3.0,
            soak_seconds=20.0,
            peer_c1=60,
            peer_c16=160,
            peer_streams=16,
            peer_enforce_s=8.0,
        )


@dataclass
class Bench:
    """One run: the plan, the table being filled and the raw figures behind it."""

    plan: BenchPlan
    workdir: Path
    sections: frozenset[str]
    table: Table = field(default_factory=Table)
    raw: dict[str, Any] = field(default_factory=dict)
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)
    _ids: int = 0

    def rid(self, prefix: str) -> str:
        """A fresh client request id."""
        self._ids += 1
        return f"bench-{prefix}-{self._ids}"
