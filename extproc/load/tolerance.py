"""Whether a load run stayed within its overshoot tolerance (``--overshoot-tolerance``, what
``ai-quota load`` exits on): the tolerance parsed, and every window that exceeded it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["overshoot_violations", "parse_tolerance"]


def parse_tolerance(text: str) -> tuple[float, bool]:
    """Parse ``--overshoot-tolerance``: ``N`` tokens or ``P%`` of the per-window limit."""
    t = text.strip()
    is_pct = t.endswith("%")
    value = float(t[:-1] if is_pct else t)
    if value < 0:
        raise ValueError("overshoot tolerance must not be negative")
    return value, is_pct


def overshoot_violations(data: Mapping[str, Any], tolerance: str = "0") -> list[str]:
    """Windows whose overshoot exceeds ``tolerance`` (tokens, or ``P%`` of the window limit)."""
    value, is_pct = parse_tolerance(tolerance)
    out: list[str] = []
    for tenant, rows in data["windows"]["tenants"].items():
        for r in rows:
            if r.get("limit") is None or r.get("overshoot") is None:
                continue
            allowed = float(r["limit"]) * value / 100.0 if is_pct else value
            if float(r["overshoot"]) > allowed:
                out.append(
                    f"{tenant}: window {r['start']:.0f} delivered {r['tokens']:.0f} "
                    f"tokens, limit {r['limit']:.0f}, overshoot {r['overshoot']:.0f} "
                    f"> tolerance {allowed:.0f}"
                )
    return out
