"""The load report as a short, fixed-width human summary (what ``ai-quota load`` prints)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["summary_text"]


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
