"""Smoke test of the benchmark suite's pure parts: ratio arithmetic, table and JSON formatting,
py-spy output parsing and the command line (no stack is started, nothing is timed)."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from extproc.bench.cli import summary
from extproc.bench.profiling import parse_pyspy_raw
from extproc.bench.report import (
    Row,
    Table,
    diff,
    document,
    per_unit_split,
    ratio,
)
from extproc.stats import median, percentile

pytestmark = pytest.mark.integration


def test_ratio_and_difference_arithmetic() -> None:
    """Ratios, differences, medians and percentiles follow their definitions; gaps give None."""
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(1.0, 0.0) is None
    assert ratio(None, 2.0) is None
    assert diff(3.5, 1.0) == 2.5
    assert diff(1.0, None) is None
    assert median([5.0, 1.0, 3.0]) == 3.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert median([]) is None
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_per_unit_split_recovers_fixed_and_per_chunk_cost() -> None:
    """Two stream lengths separate the per-request part from the per-chunk part."""
    fixed, per = per_unit_split(1000 + 50 * 60, 1000 + 500 * 60, 50, 500)
    assert fixed == pytest.approx(1000)
    assert per == pytest.approx(60)
    with pytest.raises(ValueError):
        per_unit_split(1.0, 2.0, 5, 5)


def test_table_and_json_document() -> None:
    """Rows render with baseline, value, delta, ratio and target; the JSON counts targets."""
    t = Table()
    t.add(Row("1 admission", "latency p50, c=1", "ms", 2.5, 0.5))
    t.add(Row("2 streaming", "CPU per chunk", "µs", 66.0, 60.0, target="<= 1.2x", met=True))
    t.add(Row("5 accuracy", "overshoot", "tokens", 5000.0, target="<= 4096", met=False))
    md = t.markdown()
    assert "| 1 admission | latency p50, c=1 | ms | 0.500 | 2.50 | 2.00 | 5.00x |  |" in md
    assert "| 1.10x | <= 1.2x met |" in md
    assert "| 5,000 | - | - | <= 4096 MISSED |" in md
    doc = document(t, {"cpus": 2}, {"x": [1, 2]})
    assert doc["targets"] == {"met": 1, "missed": 1}
    assert doc["rows"][0]["ratio"] == pytest.approx(5.0)
    assert doc["rows"][1]["delta"] == pytest.approx(6.0)
    orjson.dumps(doc)
    text = summary(
        t,
        {"started_at": "2026-01-01T00:00:00+00:00", "cpus": 2, "elapsed_s": 1.0, "python": "3.11"},
    )
    assert "targets: 1 met, 1 missed" in text


def test_pyspy_raw_output_is_attributed_to_leaf_functions() -> None:
    """Own time goes to the innermost frame, inclusive time to every frame of the stack."""
    raw = (
        "run (asyncio/runners.py:118);Process (extproc/server/servicer.py:44) 7\n"
        "run (asyncio/runners.py:118);Process (extproc/server/servicer.py:44);"
        "feed (extproc/core/meter.py:90) 3\n"
    )
    own, incl, mods, total = parse_pyspy_raw(raw)
    assert total == 10
    assert own["Process (server/servicer.py)"] == 7
    assert own["feed (core/meter.py)"] == 3
    assert incl["Process (server/servicer.py)"] == 10
    assert mods["core/meter.py"] == 3


def test_cli_help_exits_zero() -> None:
    """``python -m extproc.bench --help`` prints usage and exits 0."""
    out = subprocess.run(
        [sys.executable, "-m", "extproc.bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0
    assert "--quick" in out.stdout
