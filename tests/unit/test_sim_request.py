"""Unit tests of the simulator's request parsing, answer planning and configuration."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from extproc.sim.cli import config_from_args, configure_parser
from extproc.sim.config import SimConfig
from extproc.sim.controls import SimControls, parse_controls
from extproc.sim.plan import plan_answer
from extproc.sim.prompt_tokens import chat_prompt_tokens, completion_prompt_tokens
from extproc.sim.records import RecordStore
from extproc.sim.request import RequestError, parse_generation
from extproc.sim.text import count_tokens

pytestmark = pytest.mark.unit

CFG = SimConfig()
MSGS = [{"role": "user", "content": "hello there"}]


def _chat(**extra: object) -> dict[str, object]:
    return {"model": "sim-small", "messages": MSGS, **extra}


def test_max_tokens_larger_of_both_fields() -> None:
    """The effective limit is the larger of max_tokens and max_completion_tokens."""
    req = parse_generation(_chat(max_tokens=10, max_completion_tokens=30), chat=True, config=CFG)
    assert req.requested_max_tokens == 30
    req = parse_generation(_chat(max_completion_tokens=7), chat=True, config=CFG)
    assert req.requested_max_tokens == 7
    req = parse_generation(_chat(), chat=True, config=CFG)
    assert req.requested_max_tokens is None


def test_n_and_stream_options() -> None:
    """n, stream and stream_options.include_usage are read from the body."""
    req = parse_generation(
        _chat(n=3, stream=True, stream_options={"include_usage": True}), chat=True, config=CFG
    )
    assert (req.n, req.stream, req.include_usage) == (3, True, True)
    req = parse_generation(_chat(), chat=True, config=CFG)
    assert (req.n, req.stream, req.include_usage) == (1, False, False)


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"messages": MSGS}, 400),
        ({"model": "nope", "messages": MSGS}, 404),
        (_chat(n=0), 400),
        (_chat(n="2"), 400),
        (_chat(max_tokens=0), 400),
        (_chat(max_tokens=True), 400),
        (_chat(stream="yes"), 400),
        ({"model": "sim-small", "messages": []}, 400),
        ([1, 2], 400),
    ],
)
def test_invalid_bodies_rejected(body: object, status: int) -> None:
    """Invalid bodies raise RequestError with the OpenAI status."""
    with pytest.raises(RequestError) as info:
        parse_generation(body, chat=True, config=CFG)
    assert info.value.status == status


def test_completions_requires_prompt() -> None:
    """The completions endpoint needs a prompt; token arrays count one per id."""
    with pytest.raises(RequestError):
        parse_generation({"model": "sim-small"}, chat=False, config=CFG)
    req = parse_generation({"model": "sim-small", "prompt": [1, 2, 3]}, chat=False, config=CFG)
    assert req.prompt_tokens == 3


def test_prompt_token_approximation() -> None:
    """Chat prompt tokens = content tokens + 3 per message + 3."""
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Say hi"}]},
    ]
    expected = count_tokens("You are terse.") + count_tokens("Say hi") + 3 * 2 + 3
    assert chat_prompt_tokens(msgs) == expected
    assert completion_prompt_tokens(["ab", "cd"]) == count_tokens("ab") + count_tokens("cd")


def test_plan_defaults_and_caps() -> None:
    """No max_tokens -> default_tokens/stop; max_tokens -> length; cap applies."""
    cfg = SimConfig(default_tokens=20, max_tokens_cap=100)
    req = parse_generation(_chat(), chat=True, config=cfg)
    plan = plan_answer(req, SimControls(), cfg)
    assert (plan.tokens_per_choice, plan.finish_reason) == (20, "stop")
    req = parse_generation(_chat(max_tokens=50), chat=True, config=cfg)
    plan = plan_answer(req, SimControls(), cfg)
    assert (plan.tokens_per_choice, plan.finish_reason) == (50, "length")
    req = parse_generation(_chat(max_tokens=5000), chat=True, config=cfg)
    plan = plan_answer(req, SimControls(), cfg)
    assert (plan.limit, plan.tokens_per_choice, plan.finish_reason) == (100, 100, "length")


def test_plan_x_sim_tokens() -> None:
    """x-sim-tokens shortens the answer (stop) but never exceeds max_tokens."""
    req = parse_generation(_chat(max_tokens=50), chat=True, config=CFG)
    plan = plan_answer(req, SimControls(tokens=10), CFG)
    assert (plan.tokens_per_choice, plan.finish_reason) == (10, "stop")
    plan = plan_answer(req, SimControls(tokens=80), CFG)
    assert (plan.tokens_per_choice, plan.finish_reason) == (50, "length")
    plan = plan_answer(req, SimControls(tokens=10, tool_call=True), CFG)
    assert plan.finish_reason == "tool_calls"


def test_parse_controls() -> None:
    """x-sim-* headers are parsed; bad values raise 400."""
    c = parse_controls(
        {
            "x-sim-tokens": "12",
            "x-sim-itl-ms": "2.5",
            "x-sim-status": "429",
            "x-sim-tool-call": "1",
            "x-sim-reasoning": "4",
        }
    )
    assert (c.tokens, c.itl_ms, c.status, c.tool_call, c.reasoning) == (12, 2.5, 429, True, 4)
    for bad in ({"x-sim-tokens": "x"}, {"x-sim-status": "200"}, {"x-sim-itl-ms": "-1"}):
        with pytest.raises(RequestError):
            parse_controls(bad)


def test_config_validation_and_yaml(tmp_path: Path) -> None:
    """YAML config loads known keys and names an unknown key in the error."""
    good = tmp_path / "sim.yaml"
    good.write_text("port: 0\nmodels: [a, b]\nitl_ms: 1\ntext_mode: english\n")
    cfg = SimConfig.from_yaml(good)
    assert (cfg.port, cfg.models, cfg.itl_ms, cfg.text_mode) == (0, ("a", "b"), 1, "english")
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: 0\nbogus_knob: 3\n")
    with pytest.raises(ValueError, match="bogus_knob"):
        SimConfig.from_yaml(bad)
    with pytest.raises(ValueError):
        SimConfig(text_mode="nope")


def test_record_store_ring_buffer() -> None:
    """The store keeps only the newest records but running totals keep counting."""
    store = RecordStore(max_records=3)
    recs = [store.new("/v1/chat/completions", 0.0) for _ in range(5)]
    for r in recs:
        store.add_tokens(r, 2, 1.0)
        assert store.finish(r, "completed", 2.0)
        assert not store.finish(r, "client_disconnected", 3.0)
    assert [r.sim_id for r in store.list()] == [r.sim_id for r in recs[2:]]
    assert store.stats()["requests"] == 5
    assert store.stats()["tokens_sent"] == 10
    assert store.stats()["in_progress"] == 0


def test_cli_flags_override_config_file(tmp_path: Path) -> None:
    """Explicit CLI flags win over --config values; unset flags keep the file's values."""
    cfg_file = tmp_path / "sim.yaml"
    cfg_file.write_text("itl_ms: 3\nseed: 9\nmodels: [m1]\n")
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    args = parser.parse_args(
        ["--config", str(cfg_file), "--seed", "4", "--model", "a", "--model", "b"]
    )
    cfg = config_from_args(args)
    assert (cfg.itl_ms, cfg.seed, cfg.models) == (3, 4, ("a", "b"))
    assert config_from_args(parser.parse_args([])) == SimConfig()
