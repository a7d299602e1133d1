"""Integration: the load harness against the real upstream simulator, with ground-truth join."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from extproc.load import LoadConfig, run_load, validate_report
from extproc.sim.app import start_sim
from extproc.sim.config import SimConfig

pytestmark = pytest.mark.integration


@pytest.fixture
async def sim_url() -> AsyncIterator[str]:
    """Start the simulator in-process on a free loopback port."""
    runner, port = await start_sim(SimConfig(host="127.0.0.1", port=0, ttft_ms=5.0, itl_ms=1.0))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_smoke_against_simulator_joins_ground_truth(sim_url: str) -> None:
    """Every request reaches the simulator, completes, and joins its ground-truth record."""
    cfg = LoadConfig(
        targets=(f"{sim_url}/v1",),
        keys=("sk-a", "sk-b"),
        models=("sim-small",),
        stream_ratio=0.5,
        max_tokens=(8, 24),
        prompt_tokens=40,
        concurrency=4,
        requests=24,
        request_timeout=20.0,
        window_seconds=60.0,
        limits_tpm=(("sk-a", 100000),),
        sim_url=sim_url,
    )
    report = await run_load(cfg)
    assert validate_report(report) == []
    t = report.totals
    assert t["total"] == 24 and t["ok"] == 24 and t["admitted"] == 24
    gt = report.data["ground_truth"]
    assert gt["available"] is True
    assert gt["matched"] == 24 and gt["client_without_upstream"] == 0
    assert gt["endings"] == {"completed": 24}
    for r in report.records:
        assert r.upstream_tokens is not None
        assert 0 < r.upstream_tokens <= r.max_tokens
        assert r.output_tokens_client > 0
        assert r.usage_prompt_tokens is not None
    assert t["output_tokens_upstream"] == sum(r.upstream_tokens or 0 for r in report.records)
    assert t["output_tokens_delivered"] == t["output_tokens_upstream"]
    assert report.data["overshoot"]["tenants"]["sk-a"]["max_overshoot"] == 0.0


async def test_injected_disconnect_counts_as_failed(sim_url: str) -> None:
    """Streams the simulator breaks off mid-way are failures, with upstream tokens joined."""
    cfg = LoadConfig(
        targets=(f"{sim_url}/v1",),
        keys=("sk-a",),
        stream_ratio=1.0,
        max_tokens=(20, 20),
        concurrency=2,
        requests=6,
        request_timeout=20.0,
        sim_url=sim_url,
        extra_headers=(("x-sim-disconnect-after", "3"),),
    )
    report = await run_load(cfg)
    assert validate_report(report) == []
    assert report.totals["failed"] == 6
    gt = report.data["ground_truth"]
    assert gt["matched"] == 6
    assert all(r.upstream_tokens is not None and r.upstream_tokens <= 20 for r in report.records)
