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
    Target,
    diff,
    document,
    per_unit_split,
    ratio,
)
from extproc.bench.scenarios import admission, round_trips, streaming
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


def _cpu_round(cpu_us: float, msgs: float, errors: float = 0.0) -> dict[str, float]:
    return {
        "requests": 400.0,
        "errors": errors,
        "cpu_s": cpu_us * 400 / 1e6,
        "cpu_per_req_us": cpu_us,
        "msgs_per_req": msgs,
    }


def test_direct_cpu_per_request_rows() -> None:
    """Medians per arm, the ratio of each alternated round and its spread, and the 1.8x target."""
    rounds = {
        "gateway": [_cpu_round(1500, 4.0), _cpu_round(2400, 4.0), _cpu_round(1800, 4.0, 2)],
        "floor": [_cpu_round(1000, 4.0), _cpu_round(1200, 4.0), _cpu_round(900, 4.0)],
    }
    summary = admission.cpu_summary(rounds)
    assert summary["ratio_per_round"] == pytest.approx([1.5, 2.0, 2.0])
    assert summary["errors"] == {"gateway": 2, "floor": 0}
    cpu, msgs = admission.cpu_rows(summary)
    assert (cpu.value, cpu.base) == (1800, 1000)
    assert (cpu.target, cpu.met) == ("<= 1.8x", True)
    assert cpu.note == "ratio per round: median 2.00x, 1.50-2.00x, failed: gateway 2, floor 0"
    assert (msgs.value, msgs.base, msgs.ratio) == (4.0, 4.0, 1.0)
    rounds["gateway"][2] = _cpu_round(1900, 4.0)
    over = admission.cpu_rows(admission.cpu_summary(rounds))[0]
    assert (over.met, over.note) == (False, "ratio per round: median 2.00x, 1.50-2.11x")
    md = Table([over]).markdown()
    assert (
        "(ratio per round: median 2.00x, 1.50-2.11x) | µs | 1,000 | 1,900 | 900 | 1.90x | <= 1.8x MISSED |"
        in md
    )


def test_issue_17_targets() -> None:
    """Added p50 at c=1 <= 2.5 ms, per chunk <= 1.3x the floor, round trips <= 1.2 per
    non-stream and <= output/N + 1.2 per stream (9.01 for 500 tokens at N = 64)."""
    p50_goal = Target("delta", "<=", admission.ADDED_P50_C1_MS, "ms")
    assert Row("1", "p50", "ms", 3.5, 1.0, goal=p50_goal).met is True
    assert Row("1", "p50", "ms", 3.6, 1.0, goal=p50_goal).met is False
    chunk = Row(
        "2", "chunk", "µs", 131.0, 100.0, goal=Target("ratio", "<=", streaming.PER_CHUNK_RATIO)
    )
    assert (chunk.target, chunk.met) == ("<= 1.3x", False)
    assert round_trips.stream_target(500, 64) == 9.01
    assert round_trips.stream_target(512, 64) == 9.2
    assert round_trips.stream_target(100, 1) == 101.2
    per_stream = Target("value", "<=", round_trips.stream_target(500, 64), "calls")
    assert per_stream.label() == "<= 9.01 calls"
    assert Row("3", "s", "calls", 9.0, goal=per_stream).met is True
    assert Row("3", "s", "calls", 9.25, goal=per_stream).met is False
    non_stream = Target("value", "<=", round_trips.NON_STREAM_CALLS, "calls")
    assert Row("3", "n", "calls", 1.2, goal=non_stream).met is True
    assert Row("3", "n", "calls", 1.21, goal=non_stream).met is False


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
