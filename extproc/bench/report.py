"""Pure arithmetic and formatting of benchmark results: medians, percentiles, ratios, the
summary table and the JSON document.  No I/O here, so the smoke test can check it with
synthetic numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SCHEMA = "ai-quota-bench/1"


def ratio(value: float | None, base: float | None) -> float | None:
    """``value / base``; None when either is missing or the base is not positive."""
    if value is None or base is None or base <= 0:
        return None
    return value / base


def diff(value: float | None, base: float | None) -> float | None:
    """``value - base``; None when either is missing."""
    if value is None or base is None:
        return None
    return value - base


def per_unit_split(
    cost_short: float, cost_long: float, units_short: float, units_long: float
) -> tuple[float, float]:
    """Split the cost of one request into a fixed part and a per-unit part from two request
    sizes: ``cost = fixed + per_unit * units``.  Returns ``(fixed, per_unit)``."""
    if units_long == units_short:
        raise ValueError("the two sizes must differ")
    per_unit = (cost_long - cost_short) / (units_long - units_short)
    return cost_short - per_unit * units_short, per_unit


@dataclass
class Row:
    """One line of the summary: a figure with the baseline it is compared against."""

    section: str
    name: str
    unit: str
    value: float | None
    base: float | None = None
    target: str = ""
    met: bool | None = None
    note: str = ""

    @property
    def delta(self) -> float | None:
        """Value minus baseline."""
        return diff(self.value, self.base)

    @property
    def ratio(self) -> float | None:
        """Value over baseline."""
        return ratio(self.value, self.base)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form, with the derived delta and ratio."""
        return {
            "section": self.section,
            "name": self.name,
            "unit": self.unit,
            "value": self.value,
            "base": self.base,
            "delta": self.delta,
            "ratio": self.ratio,
            "target": self.target,
            "met": self.met,
            "note": self.note,
        }


def fmt(x: float | None, unit: str = "") -> str:
    """A number with about 3 significant figures (thousands separated), or '-'."""
    if x is None:
        return "-"
    if unit == "x":
        return f"{x:.2f}x"
    ax = abs(x)
    if ax >= 1000:
        s = f"{x:,.0f}"
    elif ax >= 100:
        s = f"{x:.0f}"
    elif ax >= 10:
        s = f"{x:.1f}"
    elif ax >= 1:
        s = f"{x:.2f}"
    else:
        s = f"{x:.3f}"
    return s


def _mark(met: bool | None) -> str:
    return "" if met is None else ("met" if met else "MISSED")


@dataclass
class Table:
    """Rows in display order."""

    rows: list[Row] = field(default_factory=list)

    def add(self, row: Row) -> Row:
        """Append a row and return it."""
        self.rows.append(row)
        return row

    def markdown(self) -> str:
        """The summary as a Markdown table (what the console and docs show)."""
        head = "| section | measurement | unit | baseline | gateway | Δ | ratio | target |"
        sep = "|---|---|---|---:|---:|---:|---:|---|"
        lines = [head, sep]
        for r in self.rows:
            target = " ".join(x for x in (r.target, _mark(r.met)) if x)
            name = r.name + (f" ({r.note})" if r.note else "")
            lines.append(
                f"| {r.section} | {name} | {r.unit} | {fmt(r.base)} | {fmt(r.value)} | "
                f"{fmt(r.delta)} | {fmt(r.ratio, 'x')} | {target} |"
            )
        return "\n".join(lines)

    def targets(self) -> tuple[int, int]:
        """(met, missed) over rows that have a target."""
        met = sum(1 for r in self.rows if r.met is True)
        missed = sum(1 for r in self.rows if r.met is False)
        return met, missed


def document(table: Table, meta: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """The JSON written to ``bench-results/``: schema, run metadata, rows and raw samples."""
    met, missed = table.targets()
    return {
        "schema": SCHEMA,
        "meta": meta,
        "rows": [r.as_dict() for r in table.rows],
        "targets": {"met": met, "missed": missed},
        "raw": raw,
    }
