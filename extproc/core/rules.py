"""The rule types every layer shares: limits, charging settings, bucket charges, corrections.

The bottom of the package: config compiles rules files into these, the limiter applies them,
the core does arithmetic on them.  Nothing here imports anything of the project.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ChargingMode = Literal["input_only", "reserve_max", "reserve_refund", "stream_incremental"]
StreamingMode = Literal["lazy", "strict"]

WINDOW_SECONDS: dict[str, int] = {
    "second": 1,
    "minute": 60,
    "hour": 3600,
    "day": 86400,
    "week": 7 * 86400,
}


def window_seconds(per: str) -> int:
    """A fixed window's length: a named one (0 for a month) or ``<n>s``."""
    if per.endswith("s") and per[:-1].isdigit():
        return int(per[:-1])
    return WINDOW_SECONDS.get(per, 0)


def window_period(per: str, tz: str) -> Period | None:
    """A window that follows a calendar (a week, a month, or a day in a zone other than
    UTC): its name; None for a fixed length."""
    for name in ("second", "minute", "hour", "day", "week", "month"):
        if per == name and (per in ("week", "month") or tz != "UTC"):
            return name
    return None


#: A fixed window's name by its length (the reverse of ``WINDOW_SECONDS``).
_PERIOD_NAMES: dict[int, str] = {v: k for k, v in WINDOW_SECONDS.items()}
Period = Literal["second", "minute", "hour", "day", "week", "month"]
#: ``users``: a team's distinct end users per window (a set; docs/semantics.md, "Levels")
Metric = Literal["rpm", "tpm", "cost", "concurrency", "users"]
#: Whose counter a limit is: the tenant's, each key's, or a level's (docs/semantics.md,
#: "Levels"): the organisation's, the team's, or each end user's within a team.
Scope = Literal["tenant", "key", "organisation", "team", "user"]
LEVEL_SCOPES = ("organisation", "team", "user")

#: Rates are counter units per this many tokens (a million: prices are quoted per million).
RATE_SCALE = 1_000_000


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` in integers (``b`` > 0), for any sign of ``a``."""
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class Rates:
    """What a token of each kind adds to a counter, in counter units per :data:`RATE_SCALE`
    tokens, plus a fixed amount per request.

    A TPM counter counts every token once (every rate is ``RATE_SCALE``); a money budget's
    rates are the model's prices in micro-units of the currency per million tokens; a
    weighted-token limit's rates are its weights times ``RATE_SCALE``.
    """

    input: int = RATE_SCALE
    cached_input: int = RATE_SCALE
    output: int = RATE_SCALE
    reasoning: int = RATE_SCALE
    request: int = 0

    def units(self, usage: Usage) -> int:
        """The counter units of ``usage``: each kind rounded up once (never under-charged)."""
        cached = max(0, min(usage.cached_input, usage.input))
        reasoning = max(0, min(usage.reasoning, usage.output))
        return (
            ceil_div((usage.input - cached) * self.input, RATE_SCALE)
            + ceil_div(cached * self.cached_input, RATE_SCALE)
            + ceil_div((usage.output - reasoning) * self.output, RATE_SCALE)
            + ceil_div(reasoning * self.reasoning, RATE_SCALE)
            + self.request * usage.requests
        )

    def output_units(self, tokens: int) -> int:
        """A stream charge of ``tokens`` output tokens (charge.lua computes the same)."""
        return ceil_div(tokens * self.output, RATE_SCALE)


TOKEN_RATES = Rates()
NO_RATES = Rates(0, 0, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens of one request by kind (cached input is part of input, reasoning of output)."""

    input: int = 0
    output: int = 0
    cached_input: int = 0
    reasoning: int = 0
    requests: int = 0

    @property
    def tokens(self) -> int:
        """Input plus output tokens (what a TPM counter adds)."""
        return self.input + self.output


@dataclass(frozen=True, slots=True)
class Charging:
    """Resolved charging settings for one (plan, model) pair."""

    mode: ChargingMode = "stream_incremental"
    streaming: StreamingMode = "lazy"
    charge_every_tokens: int = 64


@dataclass(frozen=True, slots=True)
class Limit:
    """One bucket rule: a metric over a window, for a model (or ``*``) and a scope.

    ``rpm`` counts requests, ``tpm`` tokens, ``cost`` money (``unit`` a currency, counters in
    micro-units, priced per model) or weighted tokens (``unit`` ``weighted``, ``weights``
    the rates), ``concurrency`` requests open at once (no window).  ``window_s`` is the
    fixed window's length; a ``month`` is a calendar month in ``tz`` (``window_s`` 0).  A
    ``shadow`` limit is counted and reported but never refuses or cuts.
    """

    metric: Metric
    limit: int
    window_s: int
    model: str  # canonical model name, or "*"
    scope: Scope
    period: Period | None = None  # None: named by window_s (second..week)
    tz: str = "UTC"
    unit: str = ""  # cost: the currency code, or "weighted"
    weights: Rates | None = None  # cost in weighted tokens: the weights
    shadow: bool = False
    sliding: bool = False
    # a level's limit (scope organisation, team or user): the organisation's or team's id
    # (user: the team whose end users it caps, one counter per end user)
    owner: str = ""

    @property
    def counts_tokens(self) -> bool:
        """TPM and cost counters are charged per token (admission, stream, settlement)."""
        return self.metric in ("tpm", "cost")

    @property
    def length_s(self) -> int:
        """The window's length in seconds, to order windows (a month as 31 days)."""
        return self.window_s or 31 * 86_400

    @property
    def period_name(self) -> str:
        """``minute``, ``month``...: the window's name in messages and keys."""
        if self.period is not None:
            return self.period
        return _PERIOD_NAMES.get(self.window_s) or f"{self.window_s}s"

    def applies_to(self, model: str) -> bool:
        """Whether a request for ``model`` is counted in this bucket."""
        return self.model in ("*", model)


@dataclass(frozen=True, slots=True)
class BucketCharge:
    """A bucket touched by a call: its key, the amount to add, its limit and expiry.

    ``kind`` is how the scripts treat the counter: ``rpm`` (a request count), ``tpm`` (any
    per-token counter: TPM, money, weighted tokens) or ``concurrency`` (a set of leased
    requests).  ``rate`` is what one output token adds (stream charges); ``refundable`` the
    part of ``amount`` given back if the request's processor dies; a ``shadow`` bucket is
    counted but never refuses.
    """

    key: str
    kind: Literal["rpm", "tpm", "concurrency", "users"]
    amount: int
    limit: int
    expire_at_ms: int
    rate: int = RATE_SCALE
    refundable: int = 0
    shadow: bool = False
    # sliding windows: the previous window's counter and the share of it (parts per million)
    # still inside the sliding window; the scripts judge current + share x previous
    prev_key: str = ""
    prev_weight: int = 0


@dataclass(frozen=True, slots=True)
class Adjustment:
    """A signed correction applied at settlement."""

    key: str
    amount: int
    expire_at_ms: int


@dataclass(frozen=True, slots=True)
class UnconfirmedCharge:
    """A stream charge whose answer never came (Redis timed out): it may still run later.
    Settlement takes back what it added if the ledger shows it ran (``seq`` reached)."""

    seq: int
    rates: tuple[tuple[str, int], ...]  # (counter key, units per RATE_SCALE output tokens)
