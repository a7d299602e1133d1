"""A plan's ``wait`` in the rules file (docs/semantics.md, "Waiting")."""

from __future__ import annotations

from pydantic import Field

from extproc.config.strict import Strict


class WaitEntry(Strict):
    """Waiting instead of an immediate 429: a request over a rate limit (RPM or TPM over a
    window shorter than a day, or concurrency) waits for its turn up to ``max_seconds``; one
    whose turn would come later is refused at once."""

    # at most 50 s: Envoy's stream_idle_timeout (60 s) must not end a request held that long
    max_seconds: float = Field(gt=0, le=50, allow_inf_nan=False)
    # live tickets the tenant's queue may hold (beyond it: an immediate 429)
    max_waiters: int = Field(default=100, ge=1, le=1000)
    # the plan's priority class (higher first); the request header x-aiquota-priority may ask
    # for another, up to max_priority (0: the header is ignored)
    priority: int = Field(default=0, ge=0, le=9)
    max_priority: int = Field(default=0, ge=0, le=9)
    # a class-c ticket queues as if it had arrived c x this earlier: no lower-class waiter is
    # passed by a higher-class one that arrived more than (difference x this) after it
    priority_boost_seconds: float = Field(default=5.0, ge=0, le=3600, allow_inf_nan=False)
