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


@dataclass(frozen=True)
class Target:
    """A goal for one measurement: produces both its label and its verdict.

    ``on`` is what is judged: ``"value"`` (the measurement), ``"ratio"`` (value / baseline) or
    ``"delta"`` (value minus baseline); ``op`` is ``"<="``, ``"<"`` or ``">="``.
    """

    on: str
    op: str
    bound: float
    unit: str = ""

    def label(self) -> str:
        """``<= 1.2x``, ``< 50 ms``, ``>= 95%``, ``Δ <= 2 ms``."""
        if self.on == "ratio":
            return f"{self.op} {self.bound:g}x"
        prefix = "Δ " if self.on == "delta" else ""
        sep = "" if self.unit == "%" else " "
        return f"{prefix}{self.op} {self.bound:g}{sep}{self.unit}".rstrip()

    def verdict(self, row: Row) -> bool | None:
        """Met or not; None when the measurement is missing."""
        x = {"value": row.value, "ratio": row.ratio, "delta": row.delta}[self.on]
        if x is None:
            return None
        if self.op == "<=":
            return x <= self.bound
        if self.op == "<":
            return x < self.bound
        return x >= self.bound


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
    goal: Target | None = None

    def __post_init__(self) -> None:
        if self.goal is not None:
            self.target = self.goal.label()
            self.met = self.goal.verdict(self)

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


DOC_START = "<!-- bench:table -->"
DOC_END = "<!-- /bench:table -->"


def table_from_json(doc: dict[str, Any]) -> str:
    """The Markdown summary of a bench JSON (what docs/performance.md embeds)."""
    rows = [
        Row(
            r["section"],
            r["name"],
            r["unit"],
            r["value"],
            r["base"],
            target=r.get("target", ""),
            met=r.get("met"),
            note=r.get("note", ""),
        )
        for r in doc["rows"]
    ]
    meta = doc.get("meta", {})
    head = (
        f"Run {meta.get('started_at', '?')}: {meta.get('cpus', '?')} CPUs, "
        f"{meta.get('elapsed_s', '?')} s, sections {', '.join(meta.get('sections', []))}"
    )
    return head + "\n\n" + Table(rows).markdown()


def render_docs(doc: dict[str, Any], text: str, source: str) -> str:
    """``text`` with the section between the bench markers replaced by ``doc``'s table."""
    if DOC_START not in text or DOC_END not in text:
        raise ValueError(f"the document has no {DOC_START} ... {DOC_END} section")
    before, rest = text.split(DOC_START, 1)
    _, after = rest.split(DOC_END, 1)
    body = f"\n<!-- generated from {source} by `ai-quota bench --render-docs`; do not edit -->\n"
    return f"{before}{DOC_START}{body}{table_from_json(doc)}\n{DOC_END}{after}"


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
