"""Write a load report to disk: JSON, per-request JSON lines and the optional plot."""

from __future__ import annotations

from pathlib import Path

import orjson

from extproc.load.plot import plot_report
from extproc.load.report import LoadReport

__all__ = ["write_report"]


def write_report(report: LoadReport, out_dir: Path, *, plot: bool = True) -> list[Path]:
    """Write ``report.json``, ``requests.jsonl`` and (optionally) ``report.png`` to ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    jpath = out_dir / "report.json"
    jpath.write_bytes(
        orjson.dumps(report.data, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS)
    )
    written.append(jpath)
    rpath = out_dir / "requests.jsonl"
    with rpath.open("wb") as fh:
        for rec in report.records:
            fh.write(orjson.dumps(rec.to_json()) + b"\n")
    written.append(rpath)
    if plot:
        ppath = out_dir / "report.png"
        plot_report(report, ppath)
        written.append(ppath)
    return written
