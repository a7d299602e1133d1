"""bench_latency_c1.py's split of py-spy samples into gRPC reads, writes and the rest."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.benchmark.bench_latency_c1 import classify, split_samples

pytestmark = pytest.mark.unit


def test_classify_reads_the_servicers_source_lines(tmp_path: Path) -> None:
    """The split goes by the frame's source line (line numbers move as code changes)."""
    src = tmp_path / "s.py"
    src.write_text("x = 1\nreq = await context.read()\nawait context.write(resp)\n")
    assert classify(f"Process ({src}:2)") == "read"
    assert classify(f"Process ({src}:3)") == "write"
    assert classify(f"Process ({src}:1)") == "other"
    assert classify("garbage") == "other"


def test_split_counts_idle_reads_writes_and_the_rest(tmp_path: Path) -> None:
    """Samples whose innermost frame is the loop's or the poller's wait are idle; the rest by
    :func:`classify`, weighted by their counts; malformed lines are skipped."""
    src = tmp_path / "s.py"
    src.write_text("x = 1\nreq = await context.read()\nawait context.write(resp)\n")
    raw = (
        f"a;Runner.run (x.py:1) 5\n"
        f"a;Process ({src}:3) 7\n"
        f"a;Process ({src}:2) 2\n"
        f"a;Process ({src}:1) 3\n"
        "not a sample\n"
    )
    assert split_samples(raw) == Counter({"idle": 5, "write": 7, "read": 2, "other": 3})


def test_the_servicers_read_and_write_lines_are_found() -> None:
    """The real servicer's gRPC calls are the lines the split looks for."""
    from extproc.server import servicer

    lines = Path(servicer.__file__).read_text().splitlines()
    kinds = {classify(f"Process ({servicer.__file__}:{n})") for n in range(1, len(lines) + 1)}
    assert {"read", "write"} <= kinds
