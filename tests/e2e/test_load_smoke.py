"""A few seconds of `ai-quota load` through the real gateway: the report is well-formed and
consistent, and it sees the refusals and cut streams the gateway produced."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from extproc.load.config import LoadConfig
from extproc.load.runner import run_load
from extproc.load.validate import validate_report
from extproc.stack import Stack

pytestmark = pytest.mark.e2e


async def test_load_through_the_gateway_reports_refusals_and_cuts(stack: Stack) -> None:
    """A tight tenant under load: streams are cut, later requests refused, totals add up."""
    report = await run_load(
        LoadConfig(
            targets=(stack.base_url,),
            keys=("sk-loadsmoke",),
            stream_ratio=1.0,
            max_tokens=(400, 400),
            prompt_tokens=20,
            concurrency=4,
            requests=16,
            duration=20.0,
            sim_url=stack.sim_url,
            limits_tpm=(("sk-loadsmoke", 300 * 60 // 3600),),
            request_timeout=30.0,
        )
    )
    assert validate_report(report) == []
    totals = report.data["totals"]
    assert totals["total"] == 16
    assert totals["cut"] >= 1
    assert totals["refused"] >= 1
    assert totals["refused_by_code"].get("tpm_limit_exceeded", 0) == totals["refused"]


def test_load_cli_writes_a_consistent_report(stack: Stack, tmp_path: Path) -> None:
    """The `ai-quota load` command runs a bounded load and writes report.json and report.png."""
    out = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "extproc",
            "load",
            "--target",
            stack.base_url,
            "--key",
            "sk-std",
            "--requests",
            "12",
            "--concurrency",
            "3",
            "--max-tokens",
            "30",
            "--no-progress",
            "--sim-url",
            stack.sim_url,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    data = orjson.loads((out / "report.json").read_bytes())
    assert validate_report(data) == []
    assert data["totals"]["ok"] == 12
    assert (out / "report.png").stat().st_size > 1000
