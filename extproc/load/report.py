"""Build, validate and summarise the load report (pure logic; :mod:`extproc.load.output` writes it).

The report is a plain JSON-able dict (``LoadReport.data``); ``validate_report`` checks its
internal consistency: ``admitted + refused + failed == total``, ``ok + cut == admitted``,
per-tenant and per-model sums equal the totals, refusal codes and failure reasons add up, and
window token sums match the delivered token totals.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from extproc.load.config import LoadConfig
from extproc.load.records import RATE_LIMIT_HEADERS, RequestRecord
from extproc.load.windows import (
    WindowRow,
    overshoot_summary,
    prompt_tokens_charged,
    tenant_windows,
)
from extproc.stats import summarize

SCHEMA = "ai-quota-load-report/1"
COUNT_KEYS: tuple[str, ...] = ("total", "admitted", "ok", "cut", "refused", "failed")
TOKEN_KEYS: tuple[str, ...] = (
    "output_tokens_client",
    "output_tokens_delivered",
    "prompt_tokens_charged",
)


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


def _close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol


def _check_counts(where: str, c: Mapping[str, Any], problems: list[str]) -> None:
    for k in COUNT_KEYS:
        v = c.get(k)
        if not isinstance(v, int) or v < 0:
            problems.append(f"{where}: {k} must be a non-negative integer, got {v!r}")
            return
    if c["admitted"] + c["refused"] + c["failed"] != c["total"]:
        problems.append(
            f"{where}: admitted + refused + failed != total "
            f"({c['admitted']} + {c['refused']} + {c['failed']} != {c['total']})"
        )
    if c["ok"] + c["cut"] != c["admitted"]:
        problems.append(f"{where}: ok + cut != admitted")
    if c["cut"] > c["admitted"]:
        problems.append(f"{where}: cut > admitted")
    if sum(c.get("refused_by_code", {}).values()) != c["refused"]:
        problems.append(f"{where}: refused_by_code does not sum to refused")
    if sum(c.get("failed_by_reason", {}).values()) != c["failed"]:
        problems.append(f"{where}: failed_by_reason does not sum to failed")
    for k in TOKEN_KEYS:
        v = c.get(k)
        if not isinstance(v, int) or v < 0:
            problems.append(f"{where}: {k} must be a non-negative integer, got {v!r}")


def _check_sum(
    where: str,
    parts: Mapping[str, Mapping[str, Any]],
    whole: Mapping[str, Any],
    problems: list[str],
) -> None:
    for k in (*COUNT_KEYS, *TOKEN_KEYS):
        got = sum(int(p.get(k) or 0) for p in parts.values())
        if got != whole.get(k):
            problems.append(f"{where}: sum of {k} is {got}, expected {whole.get(k)}")
    for k in ("refused_by_code", "failed_by_reason"):
        merged: dict[str, int] = {}
        for p in parts.values():
            for code, n in p.get(k, {}).items():
                merged[code] = merged.get(code, 0) + n
        if merged != dict(whole.get(k, {})):
            problems.append(f"{where}: merged {k} {merged} != {whole.get(k)}")


def _check_latency(where: str, lat: Mapping[str, Any], problems: list[str]) -> None:
    for name, s in lat.items():
        vals = [s.get(q) for q in ("min", "p50", "p90", "p99", "max")]
        if s.get("count", 0) == 0:
            continue
        if any(v is None for v in vals):
            problems.append(f"{where}.{name}: missing percentiles")
            continue
        if any(a > b + 1e-6 for a, b in itertools.pairwise(vals)):
            problems.append(f"{where}.{name}: percentiles not ordered {vals}")


def validate_report(report: Mapping[str, Any] | LoadReport) -> list[str]:
    """Return every internal inconsistency of ``report`` (empty list when consistent)."""
    data: Mapping[str, Any] = report.data if isinstance(report, LoadReport) else report
    problems: list[str] = []
    for section in (
        "schema",
        "run",
        "totals",
        "tenants",
        "models",
        "latency",
        "windows",
        "overshoot",
        "ground_truth",
    ):
        if section not in data:
            problems.append(f"missing section {section!r}")
    if problems:
        return problems
    totals = data["totals"]
    _check_counts("totals", totals, problems)
    tenants: Mapping[str, Mapping[str, Any]] = data["tenants"]
    _check_sum("tenants", tenants, totals, problems)
    _check_sum("models", data["models"], totals, problems)
    if "streams" in data:
        _check_sum("streams", data["streams"], totals, problems)
    _check_latency("latency", data["latency"], problems)
    for name, t in tenants.items():
        _check_counts(f"tenants.{name}", t, problems)
        _check_sum(f"tenants.{name}.models", t.get("models", {}), t, problems)
        _check_latency(f"tenants.{name}.latency", t.get("latency", {}), problems)
    for name, m in data["models"].items():
        _check_counts(f"models.{name}", m, problems)

    win_tenants: Mapping[str, list[Mapping[str, Any]]] = data["windows"].get("tenants", {})
    wsec = data["windows"].get("window_seconds")
    for name, rows in win_tenants.items():
        if name not in tenants:
            problems.append(f"windows: unknown tenant {name!r}")
            continue
        tol = 0.01 * (len(rows) + 1) + 1e-6 * float(tenants[name]["output_tokens_delivered"])
        out_sum = sum(float(r["output_tokens"]) for r in rows)
        if not _close(out_sum, float(tenants[name]["output_tokens_delivered"]), tol):
            problems.append(
                f"windows.{name}: output tokens {out_sum} != delivered "
                f"{tenants[name]['output_tokens_delivered']}"
            )
        prm_sum = sum(float(r["prompt_tokens"]) for r in rows)
        if not _close(prm_sum, float(tenants[name]["prompt_tokens_charged"]), tol):
            problems.append(
                f"windows.{name}: prompt tokens {prm_sum} != charged "
                f"{tenants[name]['prompt_tokens_charged']}"
            )
        starts = [float(r["start"]) for r in rows]
        if starts != sorted(starts):
            problems.append(f"windows.{name}: windows not sorted")
        for r in rows:
            if isinstance(wsec, int | float) and wsec > 0:
                k = float(r["start"]) / wsec
                if abs(k - round(k)) > 1e-6:
                    problems.append(f"windows.{name}: window {r['start']} not aligned to {wsec}s")
            if not _close(
                float(r["tokens"]), float(r["output_tokens"]) + float(r["prompt_tokens"]), 0.01
            ):
                problems.append(f"windows.{name}: tokens != output + prompt at {r['start']}")
            if r.get("limit") is not None:
                expect = max(0.0, float(r["tokens"]) - float(r["limit"]))
                if r.get("overshoot") is None or not _close(float(r["overshoot"]), expect, 0.01):
                    problems.append(
                        f"windows.{name}: overshoot {r.get('overshoot')} != "
                        f"max(0, tokens - limit) = {expect} at {r['start']}"
                    )
    for name, t in tenants.items():
        if (
            t.get("output_tokens_delivered", 0) + t.get("prompt_tokens_charged", 0) > 0
            and name not in win_tenants
        ):
            problems.append(f"windows: tenant {name!r} delivered tokens but has no windows")

    ov = data["overshoot"]
    maxes = [
        v.get("max_overshoot")
        for v in ov.get("tenants", {}).values()
        if v.get("max_overshoot") is not None
    ]
    expected_max = round(max(maxes), 3) if maxes else None
    if ov.get("max_overshoot") != expected_max:
        problems.append(f"overshoot.max_overshoot {ov.get('max_overshoot')} != {expected_max}")
    return problems


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}{unit}"
    return f"{v}{unit}"


def summary_text(data: Mapping[str, Any]) -> str:
    """A short, fixed-width human summary of the report."""
    t = data["totals"]
    run = data["run"]
    lines = [
        f"run {run['run_id']}  {run['mode']}-loop  {run['elapsed_s']:.1f}s  "
        f"{t['total']} requests ({t['req_per_s']:.1f} req/s)",
        f"  ok {t['ok']}  cut {t['cut']}  refused {t['refused']}  failed {t['failed']}  "
        f"(admitted {t['admitted']})",
        f"  output tokens: client {t['output_tokens_client']}  "
        f"upstream {_fmt(t['output_tokens_upstream'])}  "
        f"({t['output_tok_per_s']:.1f} tok/s)  prompt charged {t['prompt_tokens_charged']}",
    ]
    if t["refused_by_code"]:
        codes = ", ".join(f"{k}={v}" for k, v in t["refused_by_code"].items())
        lines.append(f"  429 codes: {codes}")
    if t["failed_by_reason"]:
        reasons = ", ".join(f"{k}={v}" for k, v in t["failed_by_reason"].items())
        lines.append(f"  failures: {reasons}")
    lat = data["latency"]
    lines.append(
        f"  TTFT ms p50/p90/p99 {_fmt(lat['ttft_ms']['p50'])}/{_fmt(lat['ttft_ms']['p90'])}/"
        f"{_fmt(lat['ttft_ms']['p99'])}   ITL ms p50/p90/p99 {_fmt(lat['itl_ms']['p50'])}/"
        f"{_fmt(lat['itl_ms']['p90'])}/{_fmt(lat['itl_ms']['p99'])}"
    )
    lines.append(
        f"  {'tenant':<16} {'total':>6} {'ok':>6} {'cut':>5} {'429':>5} {'fail':>5} "
        f"{'out tok':>9} {'max overshoot':>14}"
    )
    ov = data["overshoot"]["tenants"]
    for name, e in data["tenants"].items():
        mo = ov.get(name, {}).get("max_overshoot")
        lines.append(
            f"  {name[:16]:<16} {e['total']:>6} {e['ok']:>6} {e['cut']:>5} "
            f"{e['refused']:>5} {e['failed']:>5} {e['output_tokens_delivered']:>9} "
            f"{_fmt(mo):>14}"
        )
    gt = data["ground_truth"]
    if gt.get("available"):
        lines.append(f"  ground truth: matched {gt.get('matched')}  endings {gt.get('endings')}")
    return "\n".join(lines)


__all__ = [
    "LoadReport",
    "build_report",
    "count_records",
    "summary_text",
    "validate_report",
]


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
