"""The bench's peer section (LiteLLM): its config, its arithmetic and rows, and the skip when
the peer's venv cannot be made.  Nothing here installs or starts LiteLLM."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from extproc.bench import peer, system
from extproc.bench.plan import Bench, BenchPlan
from extproc.bench.scenarios import SECTIONS
from extproc.bench.scenarios import peer as section
from extproc.bench.scenarios.base import Stacks

pytestmark = pytest.mark.unit


def test_the_pin_is_exact() -> None:
    assert f"litellm[proxy]=={peer.LITELLM_VERSION}" == peer.PIN
    assert peer.LITELLM_VERSION.count(".") == 2
    assert "peer" in SECTIONS


def test_config_routes_both_models_to_the_simulator_and_limits_through_its_redis() -> None:
    cfg = peer.render_config(sim_port=18123, redis_port=16400, master_key="sk-m")
    models = {m["model_name"]: m["litellm_params"] for m in cfg["model_list"]}
    assert set(models) == {"sim-small", "sim-small-itl1", "sim-small-itl10"}
    for params in models.values():
        assert params["model"] == "openai/sim-small"
        assert params["api_base"] == "http://127.0.0.1:18123/v1"
    assert "extra_headers" not in models["sim-small"]
    assert models["sim-small-itl1"]["extra_headers"] == {"x-sim-itl-ms": "1"}
    assert models["sim-small-itl10"]["extra_headers"] == {"x-sim-itl-ms": "10"}
    assert peer.itl_model(10) == "sim-small-itl10"
    with pytest.raises(ValueError, match="no LiteLLM model"):
        peer.itl_model(3)
    general = cfg["general_settings"]
    assert general["coordination_redis"] == {"host": "127.0.0.1", "port": 16400}
    assert general["custom_auth"] == "peer_auth.user_api_key_auth"
    assert general["master_key"] == "sk-m"
    # no database, no cache, no callbacks: only what the docstring says
    assert set(cfg) == {"model_list", "general_settings"}
    assert "database_url" not in general


def test_auth_hook_gives_limited_keys_the_gateways_limit() -> None:
    """The hook is valid Python and gives ``sk-peer-limited-*`` keys the same TPM/RPM as the
    gateway's ``peer-*`` plans (per minute both)."""
    compile(peer.AUTH_MODULE, "peer_auth.py", "exec")
    assert f'api_key.startswith("{peer.LIMITED_PREFIX}")' in peer.AUTH_MODULE
    assert f"tpm_limit={system.PEER_TPM}, rpm_limit={system.PEER_RPM}" in peer.AUTH_MODULE
    plans = system.bench_rules()["plans"]
    for name in ("peer-strict", "peer-lazy"):
        (limit,) = plans[name]["limits"]
        assert (limit["per"], limit["tpm"], limit["rpm"]) == (
            "minute",
            peer.LIMITED_TPM,
            peer.LIMITED_RPM,
        )
    assert plans["peer-strict"]["charging"] == {"streaming": "strict"}
    assert "charging" not in plans["peer-lazy"]


def test_reservation_switch_is_litellms_own_variable() -> None:
    assert peer.peer_env(True)["LITELLM_TPM_TOKEN_RESERVATION_ENABLED"] == "true"
    assert peer.peer_env(False)["LITELLM_TPM_TOKEN_RESERVATION_ENABLED"] == "false"


def test_served_tokens_and_enforcement_figures() -> None:
    recs = [
        {"prompt_tokens": 105, "tokens_sent": 1000},
        {"prompt_tokens": 105, "tokens_sent": 890},
        {"prompt_tokens": 105},  # refused upstream / nothing written
    ]
    assert peer.served_tokens(recs) == 2205
    assert peer.enforcement(2205, 2000) == {
        "served": 2205.0,
        "limit": 2000.0,
        "used_pct": pytest.approx(110.25),
        "over": 205.0,
    }
    assert peer.enforcement(1000, 2000)["over"] == 0.0
    assert "delivered" not in peer.enforcement(1000, 2000)
    cut = peer.enforcement(2012, 2000, delivered=2000)
    assert (cut["over"], cut["delivered"], cut["over_delivered"]) == (12.0, 2000.0, 0.0)
    assert peer.enforcement(1000, 2000)["used_pct"] == 50.0


def _round(per_req: float, envoy: float, chunks: int = 0, requests: int = 10) -> dict[str, Any]:
    total = per_req * requests
    return {
        "requests": requests,
        "failed": 0,
        "chunks": chunks,
        "cpu_per_req_us": per_req,
        "cpu_per_chunk_us": total / chunks if chunks else None,
        "by_process": {
            "envoy": {
                "cpu_per_req_us": envoy,
                "cpu_per_chunk_us": envoy * requests / chunks if chunks else None,
            },
            "processor": {
                "cpu_per_req_us": per_req - envoy,
                "cpu_per_chunk_us": (per_req - envoy) * requests / chunks if chunks else None,
            },
        },
        "p50_ms": None,
        "ext_proc_msgs": chunks // 2,
    }


def test_cpu_rows_judge_litellm_over_gateway() -> None:
    rounds = {
        "c1": {
            "gateway": [_round(5000, 1400), _round(5200, 1400), _round(4800, 1300)],
            "litellm": [_round(30000, 0), _round(31200, 0), _round(28000, 0)],
        },
        "streams": {
            "gateway": [_round(60000, 20000, chunks=2000)] * 3,
            "litellm": [_round(250000, 0, chunks=2000)] * 3,
        },
        "streams_itl1": {
            "gateway": [_round(20000, 5000, chunks=2000)] * 3,
            "litellm": [_round(200000, 0, chunks=2000)] * 3,
        },
    }
    c1, chunk, chunk_itl1 = section.cpu_rows(rounds)
    assert "10 ms apart" in chunk.name and "1 ms apart" in chunk_itl1.name
    assert chunk_itl1.ratio == 10.0 and chunk_itl1.met is None  # reported, not judged
    assert (c1.value, c1.base) == (30000, 5000)
    assert c1.ratio == 6.0 and c1.target == ">= 6x" and c1.met is True
    assert "ours: Envoy 1400 + processor 3600 µs" in c1.note
    assert "median 6.00x, 5.83-6.00x" in c1.note
    # per chunk: 1,250 µs against 300 µs (4.2x) misses the 5x target
    assert (chunk.value, chunk.base) == (1250.0, 300.0)
    assert chunk.ratio == pytest.approx(250000 / 60000)
    assert chunk.target == ">= 5x" and chunk.met is False
    assert "ours: Envoy 100 + processor 200 µs, 2.00 chunks per ext_proc message" in chunk.note


def test_latency_rows_compare_added_p50s() -> None:
    def r(p50: float) -> dict[str, Any]:
        return {"p50_ms": p50}

    c1 = {
        "direct": [r(0.6), r(0.7), r(0.6)],
        "gateway": [r(2.6), r(2.7), r(2.5)],
        "litellm": [r(12.6), r(13.0), r(12.0)],
    }
    gw, ll, added = section.latency_rows(c1)
    assert gw.delta == pytest.approx(2.0) and ll.delta == pytest.approx(12.0)
    assert added.value == pytest.approx(12.0) and added.base == pytest.approx(2.0)
    assert added.met is True  # 2.0 <= 12.0 / 6
    c1["gateway"] = [r(2.7)] * 3
    assert section.latency_rows(c1)[2].met is False  # 2.1 > 12.0 / 6


def test_enforcement_rows_hold_the_gateway_to_its_guarantees() -> None:
    def run(served: int, delivered: int) -> dict[str, Any]:
        figures = peer.enforcement(served, 2000, delivered)
        return {"figures": figures, "admitted": 4, "refused": 9, "cut": 4}

    rows = section.enforcement_rows(
        {
            "gateway-strict": run(2010, 2000),  # 10 tokens in flight at the cuts
            "gateway-lazy": run(2230, 2200),
            "litellm-reserve": run(1105, 1105),
            "litellm-noreserve": run(5525, 5525),
        },
        every=64,
        clients=4,
    )
    by = {r.name.split(", ", 1)[1]: r for r in rows}
    assert len(rows) == 12
    strict_used = by["tokens the upstream served / limit: gateway strict"]
    assert strict_used.value == pytest.approx(100.5) and strict_used.met is True
    assert by["tokens over it, upstream: gateway strict"].value == 10.0
    assert by["tokens over it, upstream: gateway strict"].met is None  # reported
    assert by["tokens over it, delivered to clients: gateway strict"].met is True
    lazy_over = by["tokens over it, delivered to clients: gateway lazy (N = 64)"]
    assert lazy_over.value == 200.0 and lazy_over.target == "<= 256 tokens"
    assert lazy_over.met is True
    theirs = by["tokens over it, upstream: LiteLLM (token reservation off)"]
    assert theirs.value == 3525.0 and theirs.met is None  # reported, not judged
    used = by["tokens the upstream served / limit: LiteLLM (token reservation off)"]
    assert "served 5,525 of 2,000" in used.note and used.met is None
    over = section.enforcement_rows({"gateway-strict": run(1980, 2001)}, every=64, clients=4)
    assert [r.met for r in over] == [True, None, False]
    short = section.enforcement_rows({"gateway-strict": run(1970, 1970)}, every=64, clients=4)
    assert [r.met for r in short] == [False, None, True]  # 98.5 % used


def test_a_venv_that_cannot_be_made_raises_and_leaves_nothing(tmp_path: Path) -> None:
    venv = tmp_path / "venv-peer"
    with pytest.raises(peer.PeerUnavailable, match="exited"):
        peer.ensure_venv(venv, python="false")
    assert not venv.exists()
    assert not peer.installed(venv)


def test_a_stamped_venv_is_reused_without_pip(tmp_path: Path) -> None:
    venv = tmp_path / "venv-peer"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "litellm").write_text("")
    (venv / peer.STAMP).write_text(peer.PIN + "\n")
    assert peer.ensure_venv(venv, python="false") == venv / "bin" / "litellm"
    (venv / peer.STAMP).write_text("litellm[proxy]==0.0.1\n")  # another pin: reinstall
    assert not peer.installed(venv)


def test_the_section_is_skipped_not_failed_without_its_venv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cannot(*_: object, **__: object) -> Path:
        raise peer.PeerUnavailable("pip install ... exited 1: no network")

    monkeypatch.setattr(peer, "installed", lambda *_: False)
    monkeypatch.setattr(peer, "ensure_venv", cannot)
    b = Bench(plan=BenchPlan.quick(), workdir=tmp_path, sections=frozenset({"peer"}))
    b.log = lambda _: None
    stacks = Stacks(workdir=tmp_path, rules={})
    asyncio.run(section.measure(b, stacks))
    assert b.raw["peer"]["skipped"] == "LiteLLM unavailable: pip install ... exited 1: no network"
    assert b.table.rows == [] and stacks.started == []
