"""Redis key names, built in exactly one place.

Every key of one request carries the tenant as a Redis Cluster hash tag (``{tenant}``), so
one Lua script only ever touches keys of a single slot.  Fixed windows are numbered from
the Unix epoch (``window_index = now // window``), like envoyproxy/ratelimit, so every
replica and every Envoy agree on the window without talking to each other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from extproc.core.rules import Limit

EXPIRY_SLACK_MS = 2_000
_SAFE_ID = re.compile(r"[^A-Za-z0-9._:-]")


@dataclass(frozen=True, slots=True)
class WindowedBucket:
    """One bucket in the window that contains ``now``."""

    limit: Limit
    key: str
    window_end_ms: int
    expire_at_ms: int

    @property
    def metric(self) -> Literal["rpm", "tpm"]:
        """``rpm`` or ``tpm``."""
        return self.limit.metric

    def reset_s(self, now_ms: int) -> float:
        """Seconds until this window ends and the bucket starts from zero."""
        return max(0.0, (self.window_end_ms - now_ms) / 1000.0)


def tenant_tag(prefix: str, tenant: str) -> str:
    """The common prefix of every key of a tenant, including the hash tag."""
    return f"{prefix}:{{{tenant}}}"


def bucket_key(prefix: str, tenant: str, key_name: str, limit: Limit, window_index: int) -> str:
    """The counter for ``limit`` in window ``window_index``."""
    scope = "t" if limit.scope == "tenant" else f"k.{key_name}"
    return (
        f"{tenant_tag(prefix, tenant)}:{limit.metric}:{scope}:{limit.model}:"
        f"{limit.window_s}:{window_index}"
    )


def ledger_key(prefix: str, tenant: str, request_id: str) -> str:
    """The per-request ledger that makes admission, charges and settlement idempotent."""
    return f"{tenant_tag(prefix, tenant)}:req:{sanitize_request_id(request_id)}"


def open_key(ledger: str) -> str:
    """The sorted set of a tenant's open reservations, next to its ledgers (same hash tag)."""
    return ledger.rsplit(":req:", 1)[0] + ":open"


def sanitize_request_id(request_id: str) -> str:
    """A request id safe to embed in a key (no braces, bounded length)."""
    return _SAFE_ID.sub("_", request_id)[:128] or "_"


def windowed(
    prefix: str, tenant: str, key_name: str, limits: tuple[Limit, ...] | list[Limit], now_ms: int
) -> list[WindowedBucket]:
    """The buckets of ``limits`` in the windows containing ``now_ms``."""
    out: list[WindowedBucket] = []
    for lim in limits:
        w_ms = lim.window_s * 1000
        idx = now_ms // w_ms
        end = (idx + 1) * w_ms
        out.append(
            WindowedBucket(
                limit=lim,
                key=bucket_key(prefix, tenant, key_name, lim, idx),
                window_end_ms=end,
                expire_at_ms=end + EXPIRY_SLACK_MS,
            )
        )
    return out
