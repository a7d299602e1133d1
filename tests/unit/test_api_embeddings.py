"""The embeddings format (extproc.core.apis.embeddings): input shapes, counting, no output
reservation, usage, OpenAI-shaped errors, and the never-used stream parts."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.apis.base import RequestLimits
from extproc.core.apis.embeddings import EMBEDDINGS
from extproc.core.apis.errors import error_body, error_headers
from extproc.core.chunks import MalformedChunk, Usage
from extproc.core.sse import SSEDecoder
from extproc.errors import BadRequest, QuotaExceeded, RateLimitHeaders, StreamCut
from tests.apis_support import CL100K, cl100k

pytestmark = pytest.mark.unit

LIMITS = RequestLimits(max_tokens_ceiling=4096, max_n=8)


def parse(body: dict[str, Any]) -> Any:
    return EMBEDDINGS.parse(orjson.dumps(body), LIMITS)


def count(value: Any) -> int:
    return EMBEDDINGS.count_input(parse({"model": "e", "input": value}), cl100k(), CL100K)


def c(text: str) -> int:
    return cl100k().count(text)


def test_parse_reserves_no_output() -> None:
    req = parse({"model": "bge-m3", "input": "hello", "stream": True})
    assert req.api == "embeddings" and req.model == "bge-m3"
    assert req.sequences == 0 and req.declared_max_output == 0
    assert req.stream is False
    assert req.budget_fields == ()
    assert EMBEDDINGS.can_stream is False


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x"}, "model"),
        ({"model": "e"}, "input"),
        ({"model": "e", "input": None}, "input"),
        ({"model": "e", "input": ""}, "input"),
        ({"model": "e", "input": []}, "input"),
        ({"model": "e", "input": ["a", ""]}, "input"),
        ({"model": "e", "input": [[]]}, "input"),
        ({"model": "e", "input": [[1, 2], []]}, "input"),
        ({"model": "e", "input": ["a", 1]}, "input"),
        ({"model": "e", "input": [1, "a"]}, "input"),
        ({"model": "e", "input": [1.5, 2]}, "input"),
        ({"model": "e", "input": [True, 2]}, "input"),
        ({"model": "e", "input": [[1], ["a"]]}, "input"),
        ({"model": "e", "input": {"text": "x"}}, "input"),
        ({"model": "e", "input": 42}, "input"),
    ],
)
def test_parse_rejects(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse(body)
    assert info.value.status == 400
    assert info.value.param == param
    rendered = orjson.loads(EMBEDDINGS.error_body(info.value))["error"]
    assert rendered["param"] == param and rendered["type"] == "invalid_request_error"


def test_count_shapes() -> None:
    assert count("The food was delicious.") == c("The food was delicious.")
    assert count(["one fish", "two fish"]) == c("one fish") + c("two fish")
    assert count([15339, 1917, 0]) == 3
    assert count([[1, 2, 3], [4], [5, 6]]) == 6


@settings(max_examples=60, deadline=None)
@given(
    st.one_of(
        st.lists(st.text(min_size=1, max_size=60), min_size=1, max_size=6),
        st.lists(
            st.lists(st.integers(0, 100_000), min_size=1, max_size=20), min_size=1, max_size=6
        ),
    )
)
def test_count_property(value: list[Any]) -> None:
    expected = sum(c(v) if isinstance(v, str) else len(v) for v in value)
    assert count(value) == expected


def test_rewrite_only_touches_the_model() -> None:
    req = parse({"model": "alias", "input": "x", "dimensions": 256})
    out = EMBEDDINGS.rewrite(req, budget=1000, force_usage=True, model="BAAI/bge-m3")
    assert out is not None
    assert orjson.loads(out) == {"model": "BAAI/bge-m3", "input": "x", "dimensions": 256}
    req = parse({"model": "BAAI/bge-m3", "input": "x"})
    assert EMBEDDINGS.rewrite(req, budget=1000, force_usage=True, model="BAAI/bge-m3") is None
    assert EMBEDDINGS.rewrite(req, budget=None, force_usage=False, model=None) is None


def test_json_usage() -> None:
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.1, -0.2]}],
        "model": "bge-m3",
        "usage": {"prompt_tokens": 8, "total_tokens": 8},
    }
    assert EMBEDDINGS.json_usage(orjson.dumps(body)) == Usage(8, 0, 8)
    assert EMBEDDINGS.json_usage(b'{"usage": {"prompt_tokens": 5}}') == Usage(5, 0, 5)
    for bad in (b"", b"[", b"[]", b"{}", b'{"usage": {"prompt_tokens": "8"}}'):
        assert EMBEDDINGS.json_usage(bad) is None


def test_errors_are_openai_shaped() -> None:
    err = QuotaExceeded(
        "Rate limit reached for tokens per minute.",
        metric="tpm",
        retry_after_s=2.5,
        headers=RateLimitHeaders(limit_tokens=100, remaining_tokens=3, reset_tokens_s=2.5),
    )
    assert EMBEDDINGS.error_body(err) == error_body(err)
    assert EMBEDDINGS.error_headers(err) == error_headers(err)
    assert dict(EMBEDDINGS.error_headers(err))["retry-after"] == "3"


def test_stream_parts_are_inert() -> None:
    reader = EMBEDDINGS.stream_reader()
    with pytest.raises(MalformedChunk):
        reader.read(None, '{"usage": {"prompt_tokens": 1}}')
    raw = EMBEDDINGS.cut_events(StreamCut("stop", status=429, error_type="tokens", code="tpm"))
    (event,) = SSEDecoder().feed(raw)
    assert event.data is not None
    assert orjson.loads(event.data)["error"]["message"] == "stop"
