"""The per-chunk fast paths give what the general code gives: the OpenAI event reader against
a plain reading of its documented rules, the SSE decoder's one-event shortcut against the
general scan, the meter's plain forward step and the reply builder against the constructors."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import example, given, settings
from hypothesis import strategies as st

from extproc.core.apis.openai.stream import parse_event_data
from extproc.core.chunks import DONE, MalformedChunk, StreamChunk, Usage
from extproc.core.meter import Step, _forward_step
from extproc.core.sse import SSEDecoder, SSEEvent
from extproc.server import wire

pytestmark = pytest.mark.unit

_TEXT_KEYS = ("content", "reasoning_content", "reasoning", "refusal")


def _json_int(v: object) -> bool:
    return type(v) is int


def _count_or_zero(v: object) -> int:
    return v if isinstance(v, int) and _json_int(v) and v >= 0 else 0


def _texts_of(value: object, index: int) -> list[tuple[int, str]]:
    if isinstance(value, str):
        return [(index, value)] if value else []
    if isinstance(value, list):
        return [
            (index, p["text"])
            for p in value
            if isinstance(p, dict) and isinstance(p.get("text"), str) and p["text"]
        ]
    return []


def _arguments(holder: object) -> str | None:
    if not isinstance(holder, dict):
        return None
    args = holder.get("arguments")
    return args if isinstance(args, str) and args else None


def spec_read(data: str) -> StreamChunk:
    """The reader's documented rules, read plainly (module docstring of the reader)."""
    if data.strip() == DONE:
        return StreamChunk(done=True)
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise MalformedChunk("not JSON") from None
    if not isinstance(obj, dict):
        raise MalformedChunk("not an object")
    out = StreamChunk()
    err = obj.get("error")
    out.error = err if isinstance(err, dict) else {"message": err} if isinstance(err, str) else None
    choices = obj.get("choices")
    if choices is not None and not isinstance(choices, list):
        raise MalformedChunk("choices not a list")
    for choice in choices or []:
        if not isinstance(choice, dict):
            raise MalformedChunk("choice not an object")
        index = choice.get("index") if _json_int(choice.get("index")) else 0
        assert isinstance(index, int)
        delta = choice.get("delta")
        if isinstance(delta, dict):
            for key in _TEXT_KEYS:
                out.texts += _texts_of(delta.get(key), index)
            calls = delta.get("tool_calls")
            for call in calls if isinstance(calls, list) else []:
                args = _arguments(call.get("function")) if isinstance(call, dict) else None
                if args:
                    out.texts.append((index, args))
            legacy = _arguments(delta.get("function_call"))
            if legacy:
                out.texts.append((index, legacy))
        out.texts += _texts_of(choice.get("text"), index)
        reason = choice.get("finish_reason")
        if isinstance(reason, str):
            out.finish_reasons.append((index, reason))
    usage = obj.get("usage")
    if usage is not None:
        if isinstance(usage, dict):
            p, c, t = (usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
            if _json_int(p) and _json_int(c):
                assert isinstance(p, int) and isinstance(c, int)
                pd = usage.get("prompt_tokens_details")
                cd = usage.get("completion_tokens_details")
                cached = pd.get("cached_tokens") if isinstance(pd, dict) else None
                reasoning = cd.get("reasoning_tokens") if isinstance(cd, dict) else None
                out.usage = Usage(
                    p,
                    c,
                    t if isinstance(t, int) and _json_int(t) else p + c,
                    cached_input_tokens=_count_or_zero(cached),
                    reasoning_tokens=_count_or_zero(reasoning),
                )
        out.is_usage_only = out.usage is not None and not choices
    return out


_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.sampled_from(["", " the", "中", "[DONE]", "x" * 40]),
)
_parts = st.lists(st.fixed_dictionaries({}, optional={"text": _leaf, "type": _leaf}), max_size=2)
_text_value = st.one_of(_leaf, _parts)
_function = st.one_of(
    _leaf, st.fixed_dictionaries({}, optional={"arguments": _leaf, "name": _leaf})
)
_delta = st.one_of(
    _leaf,
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["assistant", None]),
            **dict.fromkeys(_TEXT_KEYS, _text_value),
            "tool_calls": st.one_of(
                _leaf, st.lists(st.one_of(_leaf, st.fixed_dictionaries({"function": _function})))
            ),
            "function_call": _function,
        },
    ),
)
_choice = st.one_of(
    _leaf,
    st.fixed_dictionaries(
        {},
        optional={
            "index": _leaf,
            "delta": _delta,
            "text": _text_value,
            "finish_reason": _leaf,
            "logprobs": _leaf,
        },
    ),
)
_usage = st.one_of(
    _leaf,
    st.fixed_dictionaries(
        {},
        optional={
            "prompt_tokens": _leaf,
            "completion_tokens": _leaf,
            "total_tokens": _leaf,
            "prompt_tokens_details": st.one_of(
                _leaf, st.fixed_dictionaries({}, optional={"cached_tokens": _leaf})
            ),
            "completion_tokens_details": st.one_of(
                _leaf, st.fixed_dictionaries({}, optional={"reasoning_tokens": _leaf})
            ),
        },
    ),
)
_event = st.one_of(
    _leaf,
    st.lists(_leaf, max_size=2),
    st.fixed_dictionaries(
        {"object": st.just("chat.completion.chunk")},
        optional={
            "choices": st.one_of(_leaf, st.lists(_choice, max_size=3)),
            "usage": _usage,
            "error": st.one_of(_leaf, st.fixed_dictionaries({"message": _leaf})),
        },
    ),
)


def _outcome(read: Any, data: str) -> StreamChunk | str:
    try:
        chunk: StreamChunk = read(data)
    except MalformedChunk:
        return "malformed"
    return chunk


_MIXED_DELTA = {
    "content": " a",
    "reasoning_content": " b",
    "reasoning": [{"text": " c"}],
    "refusal": " d",
    "tool_calls": [{"function": {"arguments": "{}"}}],
    "function_call": {"arguments": "[]"},
}


@settings(max_examples=400, deadline=None)
@given(_event)
@example({"choices": [{"index": 1, "delta": _MIXED_DELTA}]})
@example({"choices": [{"delta": {"role": "assistant", "reasoning_content": " r"}}]})
@example({"choices": [{"delta": {"content": None, "refusal": " no"}, "text": " t"}]})
@example({"choices": [{"index": True, "delta": {"content": [{"text": " p"}], "refusal": "x"}}]})
def test_openai_reader_matches_its_rules(obj: Any) -> None:
    """Any event shape: the reader's chunk (or refusal) is what its rules say."""
    data = orjson.dumps(obj).decode()
    assert _outcome(parse_event_data, data) == _outcome(spec_read, data)


@pytest.mark.parametrize("data", ["[DONE]", " [DONE]\n", "not json", "", "{"])
def test_openai_reader_done_and_garbage(data: str) -> None:
    """[DONE] (padded too) ends the stream; what is not JSON is malformed."""
    assert _outcome(parse_event_data, data) == _outcome(spec_read, data)


def _fields(ev: SSEEvent) -> tuple[object, ...]:
    return (ev.raw, ev.data, ev.event, ev.id, ev.retry, ev.is_comment_only)


def _general(chunks: list[bytes]) -> list[tuple[object, ...]]:
    """Events of ``chunks`` through the general scan (each chunk split in two feeds)."""
    dec = SSEDecoder(max_event_bytes=64)
    dec.feed(b": warm\n\n")  # past the stream start (BOM check), as the fast path requires
    out: list[tuple[object, ...]] = []
    for c in chunks:
        for part in (c[:1], c[1:]):
            if part:
                out += [_fields(e) for e in dec.feed(part)]
    return out


def _chunked(chunks: list[bytes]) -> list[tuple[object, ...]]:
    dec = SSEDecoder(max_event_bytes=64)
    dec.feed(b": warm\n\n")
    out: list[tuple[object, ...]] = []
    for c in chunks:
        out += [_fields(e) for e in dec.feed(c)]
    return out


_line = st.binary(max_size=20).filter(lambda b: b"\n" not in b)
_sse_chunk = st.one_of(
    st.builds(lambda v: b"data: " + v + b"\n\n", _line),  # the fast path's shape
    st.builds(lambda v: b"data:" + v + b"\n\n", _line),
    st.builds(lambda a, b: b"data: " + a + b"\n" + b + b"\n\n", _line, _line),
    st.builds(lambda v: b"data: " + v + b"\n", _line),  # an event cut in two
    st.builds(lambda v: v + b"\n\n", _line),
    st.binary(max_size=30),
    st.just(b"data: " + b"y" * 70 + b"\n\n"),  # over the 64-byte limit
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_sse_chunk, min_size=1, max_size=6))
def test_sse_one_event_shortcut_matches_the_general_scan(chunks: list[bytes]) -> None:
    """Fed whole or split (never the shortcut), chunks give the same events or the same
    refusal of an event over the size limit."""

    def run(f: Any) -> object:
        try:
            return f(chunks)
        except ValueError as exc:
            return type(exc).__name__

    assert run(_chunked) == run(_general)


def test_sse_shortcut_event_fields() -> None:
    """The usual chunk gives one data event holding exactly its bytes."""
    dec = SSEDecoder()
    dec.feed(b"data: a\n\n")
    chunk = b'data: {"x": "\xe4\xb8\xad"}\n\n'
    [ev] = dec.feed(chunk)
    assert ev.raw is chunk
    assert ev.data == '{"x": "中"}'
    assert (ev.event, ev.id, ev.retry, ev.is_comment_only) == (None, None, None, False)
    assert dec.pending_bytes == 0


def test_forward_step_is_a_plain_step() -> None:
    """The meter's per-chunk step equals the dataclass-built one and stays frozen."""
    step = _forward_step(b"data: x\n\n")
    assert step == Step(forward=b"data: x\n\n")
    with pytest.raises(AttributeError):
        step.charge = 1  # type: ignore[misc]


@pytest.mark.parametrize("data", [b"", b"x", b"data: hi\n\n"])
@pytest.mark.parametrize("eos", [False, True])
@pytest.mark.parametrize("meta", [None, {"output_tokens": 3, "ending": "completed"}])
def test_streamed_body_same_message_as_the_constructors(
    data: bytes, eos: bool, meta: dict[str, object] | None
) -> None:
    """The reply built by field sets is the message (and the bytes) the constructors build."""
    want = pb.ProcessingResponse(
        response_body=pb.BodyResponse(
            response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(body=data, end_of_stream=eos)
                )
            )
        )
    )
    if meta:
        want.dynamic_metadata.CopyFrom(wire.dynamic_metadata(meta))
    got = wire.streamed_body(data, eos, meta)
    assert got == want
    assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)
    assert got.response_body.response.body_mutation.WhichOneof("mutation") == "streamed_response"
