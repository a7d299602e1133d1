"""Render ``report.png``: tokens per window per tenant (with limits) and latency CDFs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from extproc.load.report import LoadReport


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    data = sorted(values)
    n = len(data)
    return data, [(i + 1) / n for i in range(n)]


def plot_report(report: LoadReport, path: Path) -> None:
    """Write a two-panel PNG for ``report`` to ``path`` (matplotlib, Agg backend)."""
    import matplotlib  # heavy import only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data: dict[str, Any] = report.data
    fig, (ax_win, ax_lat) = plt.subplots(2, 1, figsize=(10, 8))
    wsec = float(data["windows"]["window_seconds"])
    tenants: dict[str, list[dict[str, Any]]] = data["windows"]["tenants"]
    t0 = min((rows[0]["start"] for rows in tenants.values() if rows), default=0.0)
    n = max(len(tenants), 1)
    width = wsec / (n + 1)
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    for i, (tenant, rows) in enumerate(sorted(tenants.items())):
        color = colors[i % len(colors)]
        xs = [r["start"] - t0 + width * (i + 0.5) for r in rows]
        ax_win.bar(
            xs, [r["tokens"] for r in rows], width=width, label=tenant, color=color, align="edge"
        )
        limits = [r["limit"] for r in rows if r["limit"] is not None]
        if limits:
            ax_win.axhline(
                limits[0], color=color, linestyle="--", linewidth=1, label=f"{tenant} limit"
            )
    ax_win.set_title(f"Tokens per {wsec:g}s window (prompt + output) per tenant")
    ax_win.set_xlabel("seconds since first window start")
    ax_win.set_ylabel("tokens")
    if tenants:
        ax_win.legend(fontsize="small")

    ttft = [r.ttft * 1000.0 for r in report.records if r.ttft is not None and r.stream]
    itl = [x * 1000.0 for r in report.records if r.stream for x in r.inter_token_latencies()]
    for label, values in (("TTFT", ttft), ("ITL", itl)):
        if values:
            xs, ys = _cdf(values)
            ax_lat.plot(xs, ys, label=f"{label} (n={len(values)})")
    ax_lat.set_title("Latency CDF")
    ax_lat.set_xlabel("milliseconds")
    ax_lat.set_ylabel("fraction")
    if ttft or itl:
        ax_lat.set_xscale("log")
        ax_lat.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
