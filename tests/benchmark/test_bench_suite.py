"""The benchmark suite run end to end in its quick form (never part of scripts/test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.bench.plan import Bench, BenchPlan
from extproc.bench.report import document
from extproc.bench.runner import run
from extproc.bench.scenarios import SECTIONS

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
