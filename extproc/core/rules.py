"""The rule types every layer shares: limits, charging settings, bucket charges, corrections.

The bottom of the package: config compiles rules files into these, the limiter applies them,
the core does arithmetic on them.  Nothing here imports anything of the project.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ChargingMode = Literal["input_only", "reserve_max", "reserve_refund", "stream_incremental"]
StreamingMode = Literal["lazy", "strict"]

WINDOW_SECONDS: dict[str, int] = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}


@dataclass(frozen=True, slots=True)
class Charging:
    """Resolved charging settings for one (plan, model) pair."""

    mode: ChargingMode = "stream_incremental"
    streaming: StreamingMode = "lazy"
    charge_every_tokens: int = 64


@dataclass(frozen=True, slots=True)
class Limit:
    """One bucket rule: a metric over a fixed window, for a model (or ``*``) and a scope."""

    metric: Literal["rpm", "tpm"]
    limit: int
    window_s: int
    model: str  # canonical model name, or "*"
    scope: Literal["tenant", "key"]

    def applies_to(self, model: str) -> bool:
        """Whether a request for ``model`` is counted in this bucket."""
        return self.model in ("*", model)


@dataclass(frozen=True, slots=True)
class BucketCharge:
    """A bucket touched by a call: its key, the amount to add, its limit and expiry."""

    key: str
    kind: Literal["rpm", "tpm"]
    amount: int
    limit: int
    expire_at_ms: int


@dataclass(frozen=True, slots=True)
class Adjustment:
    """A signed correction applied at settlement."""

    key: str
    amount: int
    expire_at_ms: int
