"""Bench targets produce their label and verdict; docs tables are rendered from the JSON."""

from __future__ import annotations

import pytest

from extproc.bench.report import DOC_END, DOC_START, Row, Table, Target, document, render_docs

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("goal", "value", "base", "label", "met"),
    [
        (Target("ratio", "<=", 1.2), 120.0, 100.0, "<= 1.2x", True),
        (Target("ratio", "<=", 1.2), 121.0, 100.0, "<= 1.2x", False),
        (Target("value", "<", 50, "ms"), 49.9, None, "< 50 ms", True),
        (Target("value", "<", 50, "ms"), 50.0, None, "< 50 ms", False),
        (Target("value", ">=", 95, "%"), 95.0, None, ">= 95%", True),
        (Target("delta", "<=", 2, "ms"), 3.9, 1.8, "Δ <= 2 ms", False),
        (Target("delta", "<=", 2, "ms"), 3.7, 1.8, "Δ <= 2 ms", True),
        (Target("ratio", "<=", 1.35), 5.0, None, "<= 1.35x", None),
    ],
)
def test_target_label_and_verdict(
    goal: Target, value: float, base: float | None, label: str, met: bool | None
) -> None:
    row = Row("s", "m", "u", value, base, goal=goal)
    assert (row.target, row.met) == (label, met)


def _doc() -> dict[str, object]:
    t = Table([Row("1 x", "thing", "ms", 2.0, 1.0, goal=Target("ratio", "<=", 1.5))])
    meta = {"started_at": "2026-12-02T00:00:00+00:00", "cpus": 2, "elapsed_s": 1.0}
    return document(t, meta | {"sections": ["x"]}, {})


def test_render_docs_is_deterministic_and_replaces_only_the_section() -> None:
    text = f"intro\n{DOC_START}\nold table\n{DOC_END}\noutro\n"
    once = render_docs(_doc(), text, "bench-results/a.json")
    assert once == render_docs(_doc(), once, "bench-results/a.json")
    assert once.startswith("intro\n") and once.endswith("outro\n")
    assert "old table" not in once
    assert "| 1 x | thing | ms | 1.00 | 2.00 | 1.00 | 2.00x | <= 1.5x MISSED |" in once


def test_render_docs_needs_the_markers() -> None:
    with pytest.raises(ValueError, match="bench:table"):
        render_docs(_doc(), "no markers here", "x.json")
