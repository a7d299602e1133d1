"""Unit tests for request parsing, budget clamping and body rewriting (extproc.core.apis.openai.request)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from extproc.core.apis.base import ParsedRequest
from extproc.core.apis.openai.request import (
    MAX_STREAM_INTERVAL,
    effective_output_budget,
    parse_request,
    rewrite_body,
)
from extproc.core.apis.registry import api_for_path
from extproc.errors import BadRequest

pytestmark = pytest.mark.unit

CEILING = 1_000_000
MAX_N = 16
MSGS = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> bytes:
    """A chat body with model and messages plus ``fields``."""
    body: dict[str, Any] = {"model": "m", "messages": MSGS}
    body.update(fields)
    return orjson.dumps(body)


def parse(raw: bytes, endpoint: Any = "chat") -> ParsedRequest:
    """``parse_request`` with the demo ceilings."""
    return parse_request(raw, endpoint, max_tokens_ceiling=CEILING, max_n=MAX_N)


def bad(raw: bytes, endpoint: Any = "chat") -> BadRequest:
    """The BadRequest that parsing ``raw`` raises."""
    with pytest.raises(BadRequest) as info:
        parse(raw, endpoint)
    assert info.value.status == 400
    return info.value


# -- parse_request: the happy path ---------------------------------------------------------


def test_minimal_chat_defaults() -> None:
    """A minimal chat body parses with stream off, n=1 and no declared budget."""
    req = parse(chat())
    assert (req.api, req.model, req.stream, req.client_include_usage, req.sequences) == (
        "chat",
        "m",
        False,
        False,
        1,
    )
    assert req.declared_max_output is None
    assert req.body == {"model": "m", "messages": MSGS}


def test_completions_with_prompt() -> None:
    """A completions body with a prompt parses (no messages needed)."""
    req = parse(orjson.dumps({"model": "m", "prompt": "once upon"}), "completions")
    assert req.api == "completions"
    assert req.model == "m"


def test_stream_and_include_usage_read() -> None:
    """``stream`` and ``stream_options.include_usage`` are read as given."""
    req = parse(chat(stream=True, stream_options={"include_usage": True}))
    assert req.stream is True
    assert req.client_include_usage is True


def test_stream_null_means_false() -> None:
    """``stream: null`` is treated as not streaming."""
    assert parse(chat(stream=None)).stream is False


def test_stream_options_without_include_usage() -> None:
    """``stream_options`` without ``include_usage`` means the client did not ask for usage."""
    assert parse(chat(stream=True, stream_options={})).client_include_usage is False


def test_n_read() -> None:
    """A valid ``n`` (up to max_n) is kept."""
    assert parse(chat(n=3)).sequences == 3
    assert parse(chat(n=MAX_N)).sequences == MAX_N


def test_null_budget_fields_ignored() -> None:
    """``max_tokens: null`` counts as absent."""
    assert parse(chat(max_tokens=None, n=None)).declared_max_output is None


@pytest.mark.parametrize(
    ("fields", "declared"),
    [
        ({"max_tokens": 10}, 10),
        ({"max_completion_tokens": 20}, 20),
        ({"max_tokens": 10, "max_completion_tokens": 20}, 20),
        ({"max_tokens": 30, "max_completion_tokens": 20}, 30),
        ({"max_tokens": 10.0}, 10),
        ({"max_tokens": CEILING}, CEILING),
        ({"max_tokens": 1}, 1),
    ],
)
def test_declared_budget_is_larger_of_two_fields(fields: dict[str, Any], declared: int) -> None:
    """The declared budget is the larger of max_tokens / max_completion_tokens; 10.0 counts as 10."""
    req = parse(chat(**fields))
    assert req.declared_max_output == declared
    assert isinstance(req.declared_max_output, int)


# -- parse_request: errors -----------------------------------------------------------------


def test_empty_body() -> None:
    """An empty body is a 400 without a param."""
    err = bad(b"")
    assert "empty" in err.message
    assert err.param is None


def test_malformed_json() -> None:
    """A body that is not JSON is a 400 naming JSON."""
    err = bad(b'{"model": "m", ')
    assert "not valid JSON" in err.message
    assert err.param is None


@pytest.mark.parametrize("raw", [b"[]", b"42", b'"text"', b"null", b"true"])
def test_non_object_body(raw: bytes) -> None:
    """A JSON body that is not an object is a 400."""
    err = bad(raw)
    assert "must be a JSON object" in err.message


@pytest.mark.parametrize(
    "body",
    [
        {"messages": MSGS},
        {"model": "", "messages": MSGS},
        {"model": None, "messages": MSGS},
        {"model": 5, "messages": MSGS},
        {"model": ["m"], "messages": MSGS},
    ],
)
def test_missing_or_empty_model(body: dict[str, Any]) -> None:
    """A missing, empty or non-string model is a 400 with param 'model'."""
    assert bad(orjson.dumps(body)).param == "model"


@pytest.mark.parametrize("messages", [None, [], "hi", {"role": "user"}])
def test_chat_without_messages(messages: Any) -> None:
    """Chat without a non-empty messages array is a 400 with param 'messages'."""
    body: dict[str, Any] = {"model": "m"}
    if messages is not None:
        body["messages"] = messages
    assert bad(orjson.dumps(body)).param == "messages"


def test_completions_without_prompt() -> None:
    """Completions without a prompt is a 400 with param 'prompt' (messages do not help)."""
    err = bad(orjson.dumps({"model": "m", "messages": MSGS}), "completions")
    assert err.param == "prompt"


@pytest.mark.parametrize("value", ["true", 1, 0, [], {}])
def test_stream_non_bool(value: Any) -> None:
    """A non-boolean ``stream`` is a 400 with param 'stream'."""
    assert bad(chat(stream=value)).param == "stream"


@pytest.mark.parametrize("value", [True, "x", [], 1])
def test_stream_options_wrong_type(value: Any) -> None:
    """A ``stream_options`` that is not an object is a 400 with param 'stream_options'."""
    assert bad(chat(stream=True, stream_options=value)).param == "stream_options"


@pytest.mark.parametrize("value", ["true", 1, []])
def test_include_usage_non_bool(value: Any) -> None:
    """A non-boolean ``include_usage`` is a 400 with param 'stream_options'."""
    err = bad(chat(stream=True, stream_options={"include_usage": value}))
    assert err.param == "stream_options"
    assert "include_usage" in err.message


@pytest.mark.parametrize("value", [0, -1, MAX_N + 1, True, False, 1.5, "2"])
def test_n_out_of_bounds_or_wrong_type(value: Any) -> None:
    """``n`` below 1, above max_n, boolean or non-integer is a 400 with param 'n'."""
    assert bad(chat(n=value)).param == "n"


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [-1, 0, 1.5, "10", True, False, [10], CEILING + 1])
def test_budget_invalid(name: str, value: Any) -> None:
    """Negative, zero, non-integer, boolean or over-ceiling budgets are a 400 naming the field."""
    err = bad(chat(**{name: value}))
    assert err.param == name
    assert name in err.message


def test_budget_over_ceiling_message_names_ceiling() -> None:
    """The over-ceiling error quotes the ceiling."""
    err = bad(chat(max_tokens=CEILING + 5))
    assert f"at most {CEILING}" in err.message


def test_non_integer_error_message_is_bounded() -> None:
    """A huge non-integer value does not produce an unbounded error message."""
    err = bad(chat(max_tokens="x" * 10_000))
    assert len(err.message) <= 200


def test_one_bad_budget_field_fails_even_if_other_valid() -> None:
    """A valid max_tokens does not excuse an invalid max_completion_tokens."""
    err = bad(chat(max_tokens=10, max_completion_tokens=-3))
    assert err.param == "max_completion_tokens"


# -- effective_output_budget ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("declared", "cap", "expected"),
    [(None, 1024, 1024), (10, 1024, 10), (1024, 1024, 1024), (5000, 1024, 1024)],
)
def test_effective_output_budget(declared: int | None, cap: int, expected: int) -> None:
    """The per-choice budget is the declared one clamped to the model cap (cap when absent)."""
    assert effective_output_budget(declared, cap) == expected


# -- rewrite_body --------------------------------------------------------------------------


def rewritten(raw: bytes, **kw: Any) -> dict[str, Any] | None:
    """Parse ``raw``, rewrite it and decode the result (None if unchanged)."""
    req = parse(raw)
    kw.setdefault("budget", None)
    kw.setdefault("force_include_usage", False)
    out = rewrite_body(req, **kw)
    return None if out is None else orjson.loads(out)


def test_rewrite_nothing_to_change_returns_none() -> None:
    """No clamp, no forced usage and the canonical name already used → None."""
    assert rewritten(chat(max_tokens=10), budget=None, canonical_model="m") is None


def test_rewrite_clamp_below_cap_returns_none() -> None:
    """A budget already within the clamp is left alone."""
    assert rewritten(chat(max_tokens=10, max_completion_tokens=20), budget=20) is None


def test_rewrite_clamps_both_fields() -> None:
    """Both budget fields above the clamp are replaced by it."""
    out = rewritten(chat(max_tokens=5000, max_completion_tokens=3000), budget=1024)
    assert out is not None
    assert out["max_tokens"] == 1024
    assert out["max_completion_tokens"] == 1024
    assert out["messages"] == MSGS


def test_rewrite_clamps_only_field_over_cap() -> None:
    """A field below the clamp keeps its value while the other is clamped."""
    out = rewritten(chat(max_tokens=100, max_completion_tokens=3000), budget=1024)
    assert out is not None
    assert (out["max_tokens"], out["max_completion_tokens"]) == (100, 1024)


def test_rewrite_does_not_add_absent_budget_field() -> None:
    """Clamping does not invent the field the client did not send."""
    out = rewritten(chat(max_tokens=5000), budget=1024)
    assert out is not None
    assert "max_completion_tokens" not in out


def test_rewrite_clamps_integral_float_budget() -> None:
    """A float budget accepted by parse_request (5000.0) is clamped like an int."""
    out = rewritten(chat(max_tokens=5000.0), budget=1024)
    assert out is not None
    assert out["max_tokens"] == 1024


def test_rewrite_forces_include_usage_for_stream() -> None:
    """A stream without include_usage gets stream_options.include_usage=true."""
    out = rewritten(chat(stream=True), force_include_usage=True)
    assert out is not None
    assert out["stream_options"] == {"include_usage": True}


def test_rewrite_forces_include_usage_when_client_said_false() -> None:
    """``include_usage: false`` from the client is overridden to true upstream."""
    out = rewritten(
        chat(stream=True, stream_options={"include_usage": False}), force_include_usage=True
    )
    assert out is not None
    assert out["stream_options"]["include_usage"] is True


def test_rewrite_preserves_other_stream_options() -> None:
    """Forcing usage keeps the client's other stream_options keys."""
    out = rewritten(
        chat(stream=True, stream_options={"continuous_usage_stats": True}),
        force_include_usage=True,
    )
    assert out is not None
    assert out["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}


def test_rewrite_no_force_when_client_asked() -> None:
    """A client that already asked for usage gets its body unchanged."""
    raw = chat(stream=True, stream_options={"include_usage": True})
    assert rewritten(raw, force_include_usage=True) is None


def test_rewrite_no_force_for_non_stream() -> None:
    """A non-streaming request is never given stream_options."""
    assert rewritten(chat(), force_include_usage=True) is None


def test_rewrite_no_force_when_disabled() -> None:
    """With force_include_usage off a stream body is unchanged."""
    assert rewritten(chat(stream=True), force_include_usage=False) is None


def test_rewrite_alias_to_canonical_model() -> None:
    """An alias is replaced with the canonical model name; the rest is untouched."""
    out = rewritten(chat(max_tokens=7), canonical_model="real-model")
    assert out == {"model": "real-model", "messages": MSGS, "max_tokens": 7}


def test_rewrite_all_changes_together() -> None:
    """Alias, clamp and forced usage are applied in one rewrite."""
    out = rewritten(
        chat(stream=True, max_tokens=9999),
        budget=100,
        force_include_usage=True,
        canonical_model="real",
    )
    assert out is not None
    assert (out["model"], out["max_tokens"], out["stream_options"]) == (
        "real",
        100,
        {"include_usage": True},
    )


# -- endpoint_for_path ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "endpoint"),
    [
        ("/v1/chat/completions", "chat"),
        ("/v1/completions", "completions"),
        ("/chat/completions", "chat"),
        ("/completions", "completions"),
        ("/v1/chat/completions?api-version=2024-01-01", "chat"),
        ("/v1/completions?", "completions"),
        ("/v1/models", None),
        ("/v1/chat/completions/", "chat"),
        ("/v1/embeddings?x=/v1/completions", "embeddings"),
        ("", None),
    ],
)
def test_endpoint_for_path(path: str, endpoint: str | None) -> None:
    """Metered endpoints are recognised with or without a query string; others are None."""
    api = api_for_path(path)
    assert (api.name if api else None) == endpoint


def test_include_usage_null_means_absent() -> None:
    """``include_usage: null`` is treated like other nullable fields: absent (False)."""
    req = parse(chat(stream=True, stream_options={"include_usage": None}))
    assert req.client_include_usage is False


@pytest.mark.parametrize(
    ("asked", "sent"),
    [
        (100_000, MAX_STREAM_INTERVAL),
        (1e9, MAX_STREAM_INTERVAL),
        ("100000", MAX_STREAM_INTERVAL),
        ("lots", MAX_STREAM_INTERVAL),
        (None, MAX_STREAM_INTERVAL),
        (True, MAX_STREAM_INTERVAL),
        (float("nan"), MAX_STREAM_INTERVAL),
        (MAX_STREAM_INTERVAL + 1, MAX_STREAM_INTERVAL),
        (MAX_STREAM_INTERVAL, None),  # left as the client sent it: no rewrite
        (4, None),
        (1, None),
    ],
)
def test_a_streams_interval_is_at_most_the_bound(asked: Any, sent: int | None) -> None:
    """A client's ``stream_interval`` (vLLM: tokens per chunk) above the bound, or one the
    engine might read as a larger number, is lowered: tokens an engine holds back for a later
    chunk would be unseen by the meter when the client leaves."""
    req = parse(chat(stream=True, stream_interval=asked))
    out = rewrite_body(req, budget=None, force_include_usage=False)
    if sent is None:
        assert out is None or orjson.loads(out)["stream_interval"] == asked
    else:
        assert out is not None and orjson.loads(out)["stream_interval"] == sent


def test_a_non_streams_interval_is_left_to_the_engine() -> None:
    """On a non-stream the engine ignores it (the JSON path): nothing rewritten for it."""
    req = parse(chat(stream_interval=100_000))
    assert rewrite_body(req, budget=None, force_include_usage=False) is None
