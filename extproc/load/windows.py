"""Assign delivered tokens to fixed, wall-clock-aligned windows and compute overshoot (sans-IO).

A fixed-window rate limiter with a 60 s window counts tokens in ``[k*60, (k+1)*60)`` epoch
seconds. To check a run against such a limit the harness assigns every token to the window in
which it was delivered:

* output tokens follow the client's per-delta timestamps; when the upstream's ground truth says
  it wrote more tokens than the client counted, the surplus is spread uniformly over the
  upstream's first..last token times (or put at the last client delta); when it wrote fewer,
  the client deltas are scaled down so the request's total equals the ground truth;
* prompt tokens (usage ``prompt_tokens`` if reported, otherwise the harness's estimate) are
  charged at the request's start, and only for requests the upstream answered with 2xx.

The limit per window for ``--limit-tpm N`` is ``N * window_seconds / 60``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from extproc.load.records import RequestRecord

TokenEvent = tuple[float, float]
"""``(wall-clock time, tokens)``; tokens may be fractional after spreading."""


@dataclass(frozen=True)
class WindowRow:
    """Tokens one tenant was delivered in one window, against its limit when known."""

    start: float
    output_tokens: float
    prompt_tokens: float
    limit: float | None

    @property
    def tokens(self) -> float:
        """Prompt plus output tokens in the window."""
        return self.output_tokens + self.prompt_tokens

    @property
    def overshoot(self) -> float | None:
        """``max(0, tokens - limit)``; ``None`` without a limit."""
        if self.limit is None:
            return None
        return max(0.0, self.tokens - self.limit)

    @property
    def utilisation(self) -> float | None:
        """``tokens / limit``; ``None`` without a (positive) limit."""
        if self.limit is None or self.limit <= 0:
            return None
        return self.tokens / self.limit


def window_start(t: float, window_seconds: float) -> float:
    """Start of the wall-clock-aligned window containing ``t``."""
    if window_seconds <= 0:
        raise ValueError("window_seconds must be positive")
    return math.floor(t / window_seconds) * window_seconds


def spread_uniform(total: float, t0: float, t1: float, pieces: int = 20) -> list[TokenEvent]:
    """Spread ``total`` tokens uniformly over ``[t0, t1]`` as ``pieces`` equal events."""
    if total <= 0:
        return []
    if t1 <= t0:
        return [(t0, total)]
    n = max(1, pieces)
    step = (t1 - t0) / n
    return [(t0 + step * (i + 0.5), total / n) for i in range(n)]


def output_token_events(rec: RequestRecord) -> list[TokenEvent]:
    """When each output token of ``rec`` was delivered (ground truth preferred for the count)."""
    client = [
        (rec.start_wall + off, float(tok))
        for off, tok in zip(rec.delta_offsets, rec.delta_tokens, strict=True)
        if tok > 0
    ]
    client_total = sum(t for _, t in client)
    truth = rec.upstream_tokens
    if truth is None or truth == client_total:
        return client
    if truth <= 0:
        return []
    if truth < client_total:
        factor = truth / client_total
        return [(t, n * factor) for t, n in client]
    surplus = truth - client_total
    fallback = client[-1][0] if client else rec.start_wall + (rec.duration or 0.0)
    t0, t1 = rec.upstream_first_token_at, rec.upstream_last_token_at
    if t0 is None or t1 is None:
        return client + spread_uniform(surplus, fallback, fallback)
    if client:
        t0 = max(t0, client[-1][0])
    return client + spread_uniform(surplus, t0, max(t0, t1))


def prompt_tokens_charged(rec: RequestRecord) -> int:
    """Prompt tokens charged for ``rec``: usage if reported, else the estimate; 0 if not 2xx."""
    if not rec.charged:
        return 0
    if rec.usage_prompt_tokens is not None:
        return rec.usage_prompt_tokens
    return rec.prompt_tokens_estimate


def tenant_windows(
    records: Iterable[RequestRecord],
    window_seconds: float,
    limits_tpm: Mapping[str, int] | None = None,
) -> dict[str, list[WindowRow]]:
    """Per tenant, the windows (sorted, gaps filled with zero rows) and their token totals."""
    limits_tpm = limits_tpm or {}
    out_acc: dict[str, dict[float, float]] = {}
    prm_acc: dict[str, dict[float, float]] = {}
    for rec in records:
        o = out_acc.setdefault(rec.tenant, {})
        p = prm_acc.setdefault(rec.tenant, {})
        for t, n in output_token_events(rec):
            w = window_start(t, window_seconds)
            o[w] = o.get(w, 0.0) + n
        pt = prompt_tokens_charged(rec)
        if pt:
            w = window_start(rec.start_wall, window_seconds)
            p[w] = p.get(w, 0.0) + pt
    result: dict[str, list[WindowRow]] = {}
    for tenant in sorted(out_acc):
        o, p = out_acc[tenant], prm_acc[tenant]
        keys = set(o) | set(p)
        tpm = limits_tpm.get(tenant)
        limit = None if tpm is None else tpm * window_seconds / 60.0
        rows: list[WindowRow] = []
        if keys:
            first, last = min(keys), max(keys)
            count = round((last - first) / window_seconds) + 1
            for i in range(count):
                w = first + i * window_seconds
                rows.append(WindowRow(w, o.get(w, 0.0), p.get(w, 0.0), limit))
        result[tenant] = rows
    return result


def overshoot_summary(rows: list[WindowRow]) -> dict[str, float | int | None]:
    """Max and total overshoot, windows over the limit and peak utilisation for one tenant."""
    limited = [r for r in rows if r.limit is not None]
    if not limited:
        return {
            "max_overshoot": None,
            "total_overshoot": None,
            "windows_over": None,
            "max_utilisation": None,
        }
    overs = [r.overshoot or 0.0 for r in limited]
    utils = [r.utilisation for r in limited if r.utilisation is not None]
    return {
        "max_overshoot": round(max(overs), 3),
        "total_overshoot": round(sum(overs), 3),
        "windows_over": sum(1 for o in overs if o > 0),
        "max_utilisation": round(max(utils), 4) if utils else None,
    }
