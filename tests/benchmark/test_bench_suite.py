"""The benchmark suite run end to end in its quick form (never part of scripts/test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.bench.plan import Bench, BenchPlan
from extproc.bench.report import document
from extproc.bench.runner import run
from extproc.bench.scenarios import SECTIONS, round_trips

pytestmark = pytest.mark.benchmark


async def test_quick_suite_produces_every_section(tmp_path: Path) -> None:
    """Every section fills its rows and raw figures; the counted invariants hold."""
    bench = Bench(plan=BenchPlan.quick(), workdir=tmp_path, sections=frozenset(SECTIONS))
    await run(bench)
    doc = document(bench.table, {}, bench.raw)
    sections = {r["section"].split()[1] for r in doc["rows"]}
    assert {
        "admission",
        "streaming",
        "redis",
        "tokenizer",
        "accuracy",
        "stop",
        "workers",
    } <= sections
    streamed = bench.raw["redis"]["streamed, 500 tokens"]["per_request"]
    if bench.raw["redis"]["two_processors"]["allowances"]:
        # local allowances (the default): a warm tenant's charges are drawn in process
        assert streamed <= round_trips.stream_target(500, 64)
    else:
        assert 7 <= streamed <= 11  # 1 admit + ~7 charges + 1 settle with N=64
    strict = bench.raw["accuracy"]["strict"]
    assert strict["overshoot_client"] <= 0
    assert strict["delivered_client"] <= strict["sent_upstream"]


async def test_floor_processor_streams_through_envoy(tmp_path: Path) -> None:
    """The do-nothing processor forwards a whole stream (the floor's message pattern works)."""
    bench = Bench(plan=BenchPlan.quick(), workdir=tmp_path, sections=frozenset({"streaming"}))
    await run(bench)
    incomplete = bench.raw["streaming"]["latency_50"]["incomplete"]
    assert incomplete == {"baseline": 0, "gateway": 0, "floor": 0}


async def test_floor_exchanges_the_gateways_messages_per_non_stream(tmp_path: Path) -> None:
    """Through real Envoys, the floor and the gateway exchange as many ext_proc messages per
    non-streaming request (request headers and body, response headers, the JSON body read
    STREAMED), every request succeeds, and the CPU row has its issue-17 target."""
    bench = Bench(plan=BenchPlan.quick(), workdir=tmp_path, sections=frozenset({"admission"}))
    await run(bench)
    cpu = bench.raw["admission"]["cpu"]
    assert cpu["errors"] == {"gateway": 0, "floor": 0}
    msgs = {arm: cpu["median"][arm]["msgs_per_req"] for arm in ("gateway", "floor")}
    assert msgs["gateway"] >= 2
    assert msgs["floor"] == pytest.approx(msgs["gateway"], abs=0.1)
    [row] = [r for r in bench.table.rows if r.name.startswith("processor CPU per non-streaming")]
    assert row.target == "<= 1.8x"
    assert row.value is not None and row.base is not None and row.base > 0


async def test_peer_section_against_litellm(tmp_path: Path) -> None:
    """The peer section end to end (quick) when LiteLLM's venv is already made (this test does
    not install it: ``scripts/bench --only peer`` does): every request of the CPU batches
    succeeds through both proxies, both deliver every chunk, the gateway's strict run delivers
    no token over the limit, and the simulator saw every enforcement run's streams."""
    from extproc.bench import peer

    if not peer.installed():
        pytest.skip(f"{peer.VENV} not made (scripts/bench --only peer makes it)")
    bench = Bench(plan=BenchPlan.quick(), workdir=tmp_path, sections=frozenset({"peer"}))
    await run(bench)
    raw = bench.raw["peer"]
    assert "skipped" not in raw
    for kind, arms in raw["rounds"].items():
        for arm, rounds in arms.items():
            assert all(r["failed"] == 0 for r in rounds), (kind, arm)
            if kind.startswith("streams"):
                assert all(r["chunks"] == 200 * r["requests"] for r in rounds), arm
    runs = raw["enforcement"]
    assert runs["gateway-strict"]["figures"]["over_delivered"] == 0
    assert all(r["upstream_requests"] >= 1 for r in runs.values())
    assert {r.name.split(":")[0] for r in bench.table.rows} >= {
        "proxy CPU per non-streaming request, c=1",
        "added p50 latency, c=1",
    }
