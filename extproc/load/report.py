"""Building the load report from a run's records (pure logic; :mod:`extproc.load.output` writes
it): :class:`LoadReport`, a plain JSON-able dict (``LoadReport.data``) with counts per tenant
and model, latency and rate-limit header statistics, token windows and overshoot, plus the raw
records.  :mod:`extproc.load.validate` checks its consistency, :mod:`extproc.load.summary`
prints it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from extproc.load.config import LoadConfig
from extproc.load.records import RATE_LIMIT_HEADERS, RequestRecord
from extproc.load.summary import summary_text
from extproc.load.validate import COUNT_KEYS, TOKEN_KEYS, validate_report
from extproc.load.windows import (
    WindowRow,
    overshoot_summary,
    prompt_tokens_charged,
    tenant_windows,
)
from extproc.stats import summarize

__all__ = ["SCHEMA", "LoadReport", "build_report", "config_json", "count_records"]

SCHEMA = "ai-quota-load-report/1"


@dataclass(frozen=True)
class LoadReport:
    """Result of ``run_load``: the JSON report and the raw per-request records."""

    data: dict[str, Any]
    records: tuple[RequestRecord, ...] = field(default=(), repr=False)

    @property
    def totals(self) -> dict[str, Any]:
        """The ``totals`` section of the report."""
        totals: dict[str, Any] = self.data["totals"]
        return totals

    @property
    def max_overshoot(self) -> float:
        """Largest per-window overshoot over all limited tenants (0 without limits)."""
        return float(self.data["overshoot"]["max_overshoot"] or 0.0)

    def summary_text(self) -> str:
        """Short human summary (what the CLI prints)."""
        return summary_text(self.data)

    def problems(self) -> list[str]:
        """Consistency problems of the report (empty when consistent)."""
        return validate_report(self.data)


def delivered_output_tokens(rec: RequestRecord) -> int:
    """Output tokens delivered: upstream ground truth when joined, else the client count."""
    return rec.upstream_tokens if rec.upstream_tokens is not None else rec.output_tokens_client


def count_records(records: Iterable[RequestRecord]) -> dict[str, Any]:
    """Outcome counts, token sums, 429 codes and failure reasons for ``records``."""
    c: dict[str, Any] = dict.fromkeys(COUNT_KEYS, 0)
    c.update(dict.fromkeys(TOKEN_KEYS, 0))
    c["output_tokens_upstream"] = None
    c["usage_completion_tokens"] = 0
    refused_by_code: dict[str, int] = {}
    failed_by_reason: dict[str, int] = {}
    for r in records:
        c["total"] += 1
        c[r.outcome] += 1
        if r.admitted:
            c["admitted"] += 1
        if r.outcome == "refused":
            code = r.error_code or "unknown"
            refused_by_code[code] = refused_by_code.get(code, 0) + 1
        if r.outcome == "failed":
            reason = r.reason or "unknown"
            failed_by_reason[reason] = failed_by_reason.get(reason, 0) + 1
        c["output_tokens_client"] += r.output_tokens_client
        c["output_tokens_delivered"] += delivered_output_tokens(r)
        c["prompt_tokens_charged"] += prompt_tokens_charged(r)
        c["usage_completion_tokens"] += r.usage_completion_tokens or 0
        if r.upstream_tokens is not None:
            c["output_tokens_upstream"] = (c["output_tokens_upstream"] or 0) + r.upstream_tokens
    c["refused_by_code"] = dict(sorted(refused_by_code.items()))
    c["failed_by_reason"] = dict(sorted(failed_by_reason.items()))
    return c


def latency_section(records: Iterable[RequestRecord]) -> dict[str, Any]:
    """TTFT, inter-token and whole-request latency summaries in milliseconds."""
    recs = list(records)
    ttft = [r.ttft for r in recs if r.ttft is not None and r.stream]
    itl = [x for r in recs if r.stream for x in r.inter_token_latencies()]
    total = [r.duration for r in recs if r.duration is not None and r.admitted]
    return {
        "ttft_ms": summarize(ttft, 1000.0),
        "itl_ms": summarize(itl, 1000.0),
        "request_ms": summarize(total, 1000.0),
    }


def rate_limit_section(records: Iterable[RequestRecord]) -> dict[str, Any]:
    """Distinct ``x-ratelimit-limit-*`` values seen, min remaining values and retry-after stats."""
    records = list(records)
    limits: dict[str, set[str]] = {}
    remaining_min: dict[str, float] = {}
    retry_after: list[float] = []
    for r in records:
        for name in ("x-ratelimit-limit-requests", "x-ratelimit-limit-tokens"):
            if name in r.headers:
                limits.setdefault(name, set()).add(r.headers[name])
        for name in ("x-ratelimit-remaining-requests", "x-ratelimit-remaining-tokens"):
            v = _num(r.headers.get(name))
            if v is not None:
                remaining_min[name] = min(v, remaining_min.get(name, math.inf))
        if r.outcome == "refused":
            v = _num(r.headers.get("retry-after"))
            if v is not None:
                retry_after.append(v)
    return {
        "limits_seen": {k: sorted(v) for k, v in sorted(limits.items())},
        "remaining_min": dict(sorted(remaining_min.items())),
        "retry_after_s": summarize(retry_after),
        "responses_with_headers": sum(
            1 for r in records if any(h in r.headers for h in RATE_LIMIT_HEADERS)
        ),
    }


def _num(text: str | None) -> float | None:
    if text is None:
        return None
    t = text.strip().rstrip("s")
    try:
        return float(t)
    except ValueError:
        return None


def _group(records: Iterable[RequestRecord], attr: str) -> dict[str, list[RequestRecord]]:
    out: dict[str, list[RequestRecord]] = {}
    for r in records:
        out.setdefault(str(getattr(r, attr)), []).append(r)
    return dict(sorted(out.items()))


def _window_json(row: WindowRow) -> dict[str, Any]:
    ov, ut = row.overshoot, row.utilisation
    return {
        "start": row.start,
        "output_tokens": round(row.output_tokens, 3),
        "prompt_tokens": round(row.prompt_tokens, 3),
        "tokens": round(row.tokens, 3),
        "limit": None if row.limit is None else round(row.limit, 3),
        "overshoot": None if ov is None else round(ov, 3),
        "utilisation": None if ut is None else round(ut, 4),
    }


def build_report(
    records: list[RequestRecord],
    config: LoadConfig,
    *,
    started_at: float,
    ended_at: float,
    run_id: str,
    ground_truth: Mapping[str, Any] | None = None,
    run_stats: Mapping[str, Any] | None = None,
) -> LoadReport:
    """Aggregate ``records`` into the report dict."""
    elapsed = max(ended_at - started_at, 1e-9)
    totals = count_records(records)
    totals["req_per_s"] = round(totals["total"] / elapsed, 3)
    totals["admitted_per_s"] = round(totals["admitted"] / elapsed, 3)
    totals["output_tok_per_s"] = round(totals["output_tokens_delivered"] / elapsed, 3)
    totals["output_tok_per_s_client"] = round(totals["output_tokens_client"] / elapsed, 3)

    limits = config.limits
    windows = tenant_windows(records, config.window_seconds, limits)
    tenants: dict[str, Any] = {}
    by_tenant = _group(records, "tenant")
    for key in config.keys:
        by_tenant.setdefault(key, [])
    overshoot_tenants: dict[str, Any] = {}
    for tenant, recs in sorted(by_tenant.items()):
        entry = count_records(recs)
        entry["models"] = {m: count_records(rs) for m, rs in _group(recs, "model").items()}
        entry["latency"] = latency_section(recs)
        entry["rate_limit_headers"] = rate_limit_section(recs)
        entry["limit_tpm"] = limits.get(tenant)
        tenants[tenant] = entry
        if tenant in limits:
            rows = windows.get(tenant, [])
            overshoot_tenants[tenant] = {
                "limit_tpm": limits[tenant],
                "limit_per_window": round(limits[tenant] * config.window_seconds / 60.0, 3),
                **overshoot_summary(rows),
            }
    maxes = [
        float(v["max_overshoot"])
        for v in overshoot_tenants.values()
        if v["max_overshoot"] is not None
    ]

    data: dict[str, Any] = {
        "schema": SCHEMA,
        "run": {
            "run_id": run_id,
            "started_at": started_at,
            "ended_at": ended_at,
            "elapsed_s": round(elapsed, 3),
            "mode": "open" if config.open_loop else "closed",
            "config": config_json(config),
            **dict(run_stats or {}),
        },
        "totals": totals,
        "tenants": tenants,
        "models": {m: count_records(rs) for m, rs in _group(records, "model").items()},
        "streams": {
            "stream": count_records(r for r in records if r.stream),
            "non_stream": count_records(r for r in records if not r.stream),
        },
        "latency": latency_section(records),
        "windows": {
            "window_seconds": config.window_seconds,
            "tenants": {t: [_window_json(w) for w in rows] for t, rows in windows.items()},
        },
        "overshoot": {
            "tenants": overshoot_tenants,
            "max_overshoot": round(max(maxes), 3) if maxes else None,
        },
        "ground_truth": {"available": ground_truth is not None, **dict(ground_truth or {})},
    }
    return LoadReport(data=data, records=tuple(records))


def config_json(config: LoadConfig) -> dict[str, Any]:
    """The run configuration as JSON (API keys are the tenant names and are kept)."""
    return {
        "targets": list(config.targets),
        "keys": list(config.keys),
        "key_weights": None if config.key_weights is None else list(config.key_weights),
        "models": list(config.models),
        "endpoint": config.endpoint,
        "stream_ratio": config.stream_ratio,
        "max_tokens": list(config.max_tokens),
        "prompt_tokens": config.prompt_tokens,
        "concurrency": None if config.open_loop else config.concurrency,
        "rate": config.rate,
        "arrival": config.arrival if config.open_loop else None,
        "max_in_flight": config.max_in_flight if config.open_loop else None,
        "duration_s": config.effective_duration,
        "requests": config.requests,
        "request_timeout_s": config.request_timeout,
        "window_seconds": config.window_seconds,
        "limits_tpm": config.limits,
        "sim_url": config.sim_url,
        "include_usage": config.include_usage,
        "seed": config.seed,
    }
