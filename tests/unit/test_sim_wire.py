"""Unit tests of the simulator's wire encoders, stream scripts and new request parsing."""

from __future__ import annotations

import zlib
from typing import Any

import orjson
import pytest

from extproc.sim.config import TEXT_MODES, SimConfig
from extproc.sim.controls import SimControls, UsageLie, parse_controls, parse_usage_lie
from extproc.sim.plan import plan_answer
from extproc.sim.request import (
    RequestError,
    parse_embeddings,
    parse_generation,
    parse_messages,
    parse_responses,
)
from extproc.sim.script import (
    END_ABORT,
    END_EOF,
    END_ERROR_EVENT,
    Gzip,
    Triggers,
    UsageFunc,
    build_stream,
    burst,
)
from extproc.sim.text import count_tokens, generate_pieces
from extproc.sim.wire import ENCODERS
from extproc.sim.wire.base import CONTENT, REASONING, TOOL, Unit, WireContext
from extproc.sim.wire.messages import tool_json_overhead, tool_json_units

pytestmark = pytest.mark.unit

CFG = SimConfig()


def _ctx(**kw: Any) -> WireContext:
    base: dict[str, Any] = {
        "sim_id": "sim-1",
        "model": "sim-small",
        "created": 1,
        "prompt_tokens": 5,
        "include_usage": True,
        "finish_reason": "stop",
        "choices": 1,
        "tool": False,
    }
    base.update(kw)
    return WireContext(**base)


def _units(n: int, reasoning: int = 0, kind: str = CONTENT) -> list[Unit]:
    pieces = generate_pieces("mixed", 3, 0, n)
    return [Unit(p, 1, REASONING if i < reasoning else kind) for i, p in enumerate(pieces)]


def _events(data: bytes) -> list[tuple[str | None, Any]]:
    """(event name, decoded data) of every SSE event in ``data``."""
    out: list[tuple[str | None, Any]] = []
    for block in data.split(b"\n\n"):
        if not block:
            continue
        name = None
        payload = b""
        for line in block.split(b"\n"):
            if line.startswith(b"event: "):
                name = line[7:].decode()
            elif line.startswith(b"data: "):
                payload = line[6:]
        out.append((name, None if payload == b"[DONE]" else orjson.loads(payload)))
    return out


def _script(
    api: str,
    units: list[list[Unit]],
    per_chunk: int = 1,
    triggers: Triggers | None = None,
    **kw: Any,
) -> Any:
    ctx = _ctx(choices=len(units), **kw)
    return build_stream(
        ENCODERS[api](ctx),
        units,
        per_chunk=per_chunk,
        interval=0.01 * per_chunk,
        triggers=triggers or Triggers(),
        usage_for=UsageFunc(),
    )


@pytest.mark.parametrize("api", ["chat", "completions", "responses", "messages"])
@pytest.mark.parametrize("per_chunk", [1, 3, 7])
def test_chunks_carry_k_tokens_and_all_tokens_are_scripted(api: str, per_chunk: int) -> None:
    """Every content frame carries per_chunk tokens (last may be shorter); the sum is exact."""
    units = _units(20)
    script = _script(api, [units], per_chunk)
    carrying = [f.tokens for f in script.frames if f.tokens]
    assert sum(carrying) == script.output_tokens == 20
    assert carrying[:-1] == [per_chunk] * (len(carrying) - 1)
    assert 1 <= carrying[-1] <= per_chunk
    assert script.end == END_EOF
    assert script.usage_reported == 20


def test_responses_event_sequence_with_reasoning() -> None:
    """Typed events in order with consecutive sequence numbers; deltas rebuild the text."""
    units = _units(10, reasoning=3)
    script = _script("responses", [units], finish_reason="length", max_output_tokens=10)
    events = _events(b"".join(f.data for f in script.frames))
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.incomplete"
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert all(n == d["type"] for n, d in events)
    reasoning = "".join(d["delta"] for n, d in events if n == "response.reasoning_text.delta")
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert reasoning == "".join(u.text for u in units[:3])
    assert text == "".join(u.text for u in units[3:])
    final = events[-1][1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == 10
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]


def test_messages_event_sequence_thinking_then_tool() -> None:
    """Anthropic stream: message_start, blocks with ping after the first start, message_stop."""
    inner = generate_pieces("mixed", 3, 99, 6)
    units = _units(2, reasoning=2) + tool_json_units(inner)
    script = _script("messages", [units], tool=True, finish_reason="tool_calls")
    events = _events(b"".join(f.data for f in script.frames))
    names = [n for n, _ in events]
    assert names[0] == "message_start"
    assert names[1:3] == ["content_block_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    assert events[0][1]["message"]["usage"]["output_tokens"] == 1
    partial = "".join(
        d["delta"]["partial_json"]
        for n, d in events
        if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
    )
    assert orjson.loads(partial) == {"text": "".join(inner)}
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert delta["usage"]["output_tokens"] == script.output_tokens == 2 + 6 + tool_json_overhead()


@pytest.mark.parametrize("mode", TEXT_MODES)
@pytest.mark.parametrize("seed", range(20))
def test_tool_json_wrapper_is_token_exact(mode: str, seed: int) -> None:
    """count_tokens of the whole JSON equals the sum of the unit token counts."""
    for count in (0, 1, 5, 40):
        units = tool_json_units(generate_pieces(mode, seed, 1_000_000, count))
        text = "".join(u.text for u in units)
        assert count_tokens(text) == sum(u.tokens for u in units)
        assert orjson.loads(text)["text"] == "".join(u.text for u in units[1:-1])


def test_triggers_cut_chunks_and_end_script() -> None:
    """A chunk never straddles an injection; error event / disconnect end the script."""
    script = _script("chat", [_units(20)], 4, triggers=Triggers(malformed=6, disconnect=10))
    carrying = [f.tokens for f in script.frames if f.tokens]
    assert carrying == [4, 2, 4]
    assert script.end == END_ABORT
    assert [f.note for f in script.frames if f.note] == ["malformed"]
    script = _script("messages", [_units(20)], 4, triggers=Triggers(error_event=5))
    assert script.end == END_ERROR_EVENT
    assert script.output_tokens == 5
    assert _events(script.frames[-1].data)[0][0] == "error"


def test_burst_merges_everything_into_one_frame() -> None:
    """burst() keeps bytes, token total and the usage marker."""
    script = _script("chat", [_units(9)], 3)
    (one,) = burst(script.frames)
    assert one.data == b"".join(f.data for f in script.frames)
    assert one.tokens == 9
    assert one.usage_reported == 9


def test_gzip_chunks_decode_incrementally() -> None:
    """Each flushed gzip chunk decodes at once to exactly its input."""
    zipper = Gzip()
    decoder = zlib.decompressobj(wbits=31)
    for part in (b"data: a\n\n", b"data: b\n\n", b"x" * 1000):
        assert decoder.decompress(zipper.chunk(part)) == part
    assert decoder.decompress(zipper.finish()) == b""
    assert decoder.eof


def test_usage_lie_parsing() -> None:
    """x-sim-usage: int, scale:<f>, absent; other values are 400."""
    assert parse_usage_lie("7") == UsageLie("fixed", 7.0)
    assert parse_usage_lie("scale:0.5") == UsageLie("scale", 0.5)
    assert parse_usage_lie(" Absent ") == UsageLie("absent")
    assert parse_usage_lie(None) is None
    for bad in ("x", "-1", "scale:x", "scale:-2"):
        with pytest.raises(RequestError):
            parse_usage_lie(bad)
    assert UsageFunc(UsageLie("scale", 0.5))(11, 2).output == 6
    assert UsageFunc(UsageLie("fixed", 3))(11, 2).output == 3
    assert UsageFunc(UsageLie("absent"))(11, 2).output is None
    assert UsageFunc()(11, 2).output == 11


def test_usage_absent_drops_chat_usage_chunk() -> None:
    """With usage absent the chat stream has no usage chunk even with include_usage."""
    ctx = _ctx()
    script = build_stream(
        ENCODERS["chat"](ctx),
        [_units(3)],
        per_chunk=1,
        interval=0.0,
        triggers=Triggers(),
        usage_for=UsageFunc(UsageLie("absent")),
    )
    events = _events(b"".join(f.data for f in script.frames))
    assert not any(d and d.get("usage") for _, d in events)
    assert script.usage_reported is None


def test_parse_new_controls() -> None:
    """The fault headers are parsed; burst wins over chunk over tokens-per-chunk."""
    c = parse_controls(
        {
            "x-sim-gzip": "1",
            "x-sim-honour-accept-encoding": "true",
            "x-sim-content-type": "none",
            "x-sim-chunk-tokens": "4",
            "x-sim-usage": "scale:2",
            "x-sim-ignore-max-tokens": "1",
            "x-sim-content-length": "yes",
        }
    )
    assert (c.gzip, c.honour_accept_encoding, c.content_type) == (True, True, "none")
    assert (c.chunk_tokens, c.per_chunk, c.ignore_max_tokens, c.content_length) == (
        4,
        4,
        True,
        True,
    )
    assert parse_controls({"x-sim-burst-tokens": "5", "x-sim-chunk-tokens": "2"}).per_chunk == 5
    assert parse_controls({}).per_chunk is None
    for bad in ({"x-sim-chunk-tokens": "0"}, {"x-sim-burst-tokens": "x"}, {"x-sim-usage": "?"}):
        with pytest.raises(RequestError):
            parse_controls(bad)


def test_ignore_max_tokens_runs_to_context_end() -> None:
    """Without a budget and with the flag the answer is context - prompt tokens, finish length."""
    cfg = SimConfig(context_tokens=300, default_tokens=20)
    req = parse_generation(
        {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]},
        chat=True,
        config=cfg,
    )
    plan = plan_answer(req, SimControls(ignore_max_tokens=True), cfg)
    assert plan.tokens_per_choice == 300 - req.prompt_tokens
    assert plan.finish_reason == "length"
    assert plan_answer(req, SimControls(), cfg).tokens_per_choice == 20
    with_budget = parse_generation(
        {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9},
        chat=True,
        config=cfg,
    )
    assert plan_answer(with_budget, SimControls(ignore_max_tokens=True), cfg).limit == 9


def test_completions_batch_prompts() -> None:
    """A list of prompts is a batch: choices = prompts x n; a token-id list is one prompt."""
    req = parse_generation(
        {"model": "sim-small", "prompt": ["a", "b c", "d"], "n": 2}, chat=False, config=CFG
    )
    assert (req.prompts, req.n, req.choices) == (3, 2, 6)
    assert req.prompt_tokens == count_tokens("a") + count_tokens("b c") + count_tokens("d")
    one = parse_generation({"model": "sim-small", "prompt": [1, 2, 3]}, chat=False, config=CFG)
    assert (one.prompts, one.prompt_tokens) == (1, 3)
    ids = parse_generation({"model": "sim-small", "prompt": [[1, 2], [3]]}, chat=False, config=CFG)
    assert (ids.prompts, ids.prompt_tokens) == (2, 3)
    with pytest.raises(RequestError):
        parse_generation(
            {"model": "sim-small", "prompt": "a", "n": 3, "best_of": 2}, chat=False, config=CFG
        )


def test_parse_responses_messages_embeddings() -> None:
    """Budgets, input-token approximations and validation of the new APIs."""
    r = parse_responses(
        {
            "model": "sim-small",
            "input": "hello there",
            "instructions": "be short",
            "max_output_tokens": 9,
        },
        config=CFG,
    )
    assert (r.requested_max_tokens, r.n, r.include_usage) == (9, 1, True)
    assert r.prompt_tokens == count_tokens("hello there") + count_tokens("be short") + 3 + 3 + 3
    items = parse_responses(
        {
            "model": "sim-small",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hello there"}]}],
        },
        config=CFG,
    )
    assert items.prompt_tokens == count_tokens("hello there") + 6
    with pytest.raises(RequestError):
        parse_responses({"model": "sim-small"}, config=CFG)
    m = parse_messages(
        {
            "model": "sim-small",
            "max_tokens": 7,
            "system": [{"type": "text", "text": "be short"}],
            "messages": [{"role": "user", "content": "hello there"}],
        },
        config=CFG,
    )
    assert (m.requested_max_tokens, m.prompt_tokens) == (
        7,
        count_tokens("hello there") + count_tokens("be short") + 9,
    )
    with pytest.raises(RequestError) as err:
        parse_messages(
            {"model": "sim-small", "messages": [{"role": "user", "content": "x"}]}, config=CFG
        )
    assert err.value.param == "max_tokens"
    e = parse_embeddings({"model": "sim-small", "input": ["a b", "c"], "dimensions": 4}, config=CFG)
    assert (e.input_tokens, e.dimensions, e.encoding_format) == (
        (count_tokens("a b"), 1),
        4,
        "float",
    )
    ids = parse_embeddings({"model": "sim-small", "input": [1, 2, 3]}, config=CFG)
    assert (ids.input_tokens, ids.dimensions) == ((3,), 8)
    bads: list[dict[str, Any]] = [
        {"input": []},
        {"input": [1, "a"]},
        {"input": "a", "encoding_format": "x"},
    ]
    for bad in bads:
        with pytest.raises(RequestError):
            parse_embeddings({"model": "sim-small", **bad}, config=CFG)


def test_unary_bodies() -> None:
    """Non-streaming bodies of the new APIs carry text and usage in their own shapes."""
    from extproc.sim.wire.base import ChoiceOutput, UsageReport

    out = [ChoiceOutput(0, " think", " hello world")]
    usage = UsageReport(output=3, reasoning=1)
    resp = ENCODERS["responses"](_ctx()).body(out, usage)
    assert resp["status"] == "completed"
    assert resp["output"][-1]["content"][0] == {
        "type": "output_text",
        "text": " hello world",
        "annotations": [],
        "logprobs": [],
    }
    assert resp["usage"]["total_tokens"] == 8
    msg = ENCODERS["messages"](_ctx(finish_reason="length")).body(out, usage)
    assert msg["stop_reason"] == "max_tokens"
    assert [b["type"] for b in msg["content"]] == ["thinking", "text"]
    assert msg["usage"]["output_tokens"] == 3
    no_usage = ENCODERS["chat"](_ctx()).body(out, UsageReport(output=None, reasoning=0))
    assert "usage" not in no_usage
    assert TOOL != CONTENT


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_a_stream_interval_sends_the_first_token_alone_then_that_many_per_chunk(api: str) -> None:
    """vLLM's per-request ``stream_interval``: parsed from the body; the first chunk holds one
    token, the next ones the interval, the last the rest; every token scripted once."""
    req = parse_generation(
        {
            "model": "sim-small",
            "prompt": "a",
            "messages": [{"role": "user", "content": "a"}],
            "stream": True,
            "stream_interval": 8,
        },
        chat=api == "chat",
        config=CFG,
    )
    assert req.stream_interval == 8
    ctx = _ctx(choices=1)
    script = build_stream(
        ENCODERS[api](ctx),
        [_units(20)],
        per_chunk=8,
        first_chunk=1,
        interval=0.08,
        triggers=Triggers(),
        usage_for=UsageFunc(),
    )
    carrying = [(f.tokens, round(f.at, 3)) for f in script.frames if f.tokens]
    assert carrying == [(1, 0.0), (8, 0.08), (8, 0.16), (3, 0.24)]
    with pytest.raises(RequestError):
        parse_generation(
            {"model": "sim-small", "prompt": "a", "stream_interval": 0}, chat=False, config=CFG
        )
