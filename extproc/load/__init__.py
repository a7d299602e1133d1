"""Load-test harness for the quota gateway (`ai-quota load`).

Drives concurrent streaming and non-streaming OpenAI-compatible clients against one or more
loopback base URLs, records per-request outcomes (ok / refused / cut / failed), joins them with
the simulator's ground truth when available and builds a JSON + PNG report.

Programmatic use::

    from extproc.load import LoadConfig, run_load
    report = await run_load(LoadConfig(targets=("http://127.0.0.1:10000/v1",), keys=("sk-a",)))
"""

from __future__ import annotations

from extproc.load.config import LoadConfig
from extproc.load.report import LoadReport
from extproc.load.runner import run_load
from extproc.load.validate import validate_report

__all__ = ["LoadConfig", "LoadReport", "run_load", "validate_report"]
