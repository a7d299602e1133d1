"""The load report's consistency rules (pure logic): the counters every section holds
(:data:`COUNT_KEYS`, :data:`TOKEN_KEYS`) and :func:`validate_report`, which checks that
``admitted + refused + failed == total``, ``ok + cut == admitted``, per-tenant and per-model sums
equal the totals, refusal codes and failure reasons add up, and window token sums match the
delivered token totals.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["COUNT_KEYS", "TOKEN_KEYS", "validate_report"]

COUNT_KEYS: tuple[str, ...] = ("total", "admitted", "ok", "cut", "refused", "failed")
TOKEN_KEYS: tuple[str, ...] = (
    "output_tokens_client",
    "output_tokens_delivered",
    "prompt_tokens_charged",
)


class _Report(Protocol):
    """A built report (:class:`extproc.load.report.LoadReport`)."""

    @property
    def data(self) -> Mapping[str, Any]:
        """The JSON-able report."""
        ...


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


def validate_report(report: Mapping[str, Any] | _Report) -> list[str]:
    """Return every internal inconsistency of ``report`` (empty list when consistent)."""
    data: Mapping[str, Any] = report if isinstance(report, Mapping) else report.data
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
