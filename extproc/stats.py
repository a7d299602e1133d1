"""Small, dependency-free statistics shared by the side tools (load report, benchmarks)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


def median(values: Iterable[float]) -> float | None:
    """Median of the values (None when empty)."""
    xs = sorted(values)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation; ``None`` for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    if not values:
        return None
    data = sorted(values)
    if len(data) == 1:
        return float(data[0])
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return float(data[lo])
    frac = pos - lo
    return float(data[lo] + (data[hi] - data[lo]) * frac)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, Any]:
    """Count, mean, min, p50, p90, p99 and max of ``values`` multiplied by ``scale``."""
    if not values:
        return {
            "count": 0,
            "mean": None,
            "min": None,
            "p50": None,
            "p90": None,
            "p99": None,
            "max": None,
        }
    scaled = [v * scale for v in values]
    return {
        "count": len(scaled),
        "mean": _r(sum(scaled) / len(scaled)),
        "min": _r(min(scaled)),
        "p50": _r(percentile(scaled, 50)),
        "p90": _r(percentile(scaled, 90)),
        "p99": _r(percentile(scaled, 99)),
        "max": _r(max(scaled)),
    }


def slope_per_minute(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) samples, per minute."""
    n = len(samples)
    if n < 2:
        return 0.0
    mx = sum(t for t, _ in samples) / n
    my = sum(v for _, v in samples) / n
    var = sum((t - mx) ** 2 for t, _ in samples)
    if var == 0:
        return 0.0
    cov = sum((t - mx) * (v - my) for t, v in samples)
    return cov / var * 60.0


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)
