"""Unit tests for OpenAI-shaped error bodies, 429 headers and the in-stream error event (extproc.core.apis.errors, extproc.errors)."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.apis.errors import error_body, error_headers, sse_error_event
from extproc.core.sse import SSEDecoder
from extproc.errors import (
    AuthenticationError,
    BadRequest,
    GatewayError,
    InternalError,
    LimiterUnavailable,
    PathNotAllowed,
    QuotaExceeded,
    RateLimitHeaders,
    RequestTooLarge,
    UnknownModel,
    format_duration,
)

pytestmark = pytest.mark.unit

FULL_HEADERS = RateLimitHeaders(
    limit_requests=60,
    remaining_requests=0,
    reset_requests_s=12.5,
    limit_tokens=2000,
    remaining_tokens=150,
    reset_tokens_s=0.12,
)


def quota(retry: float | None, headers: RateLimitHeaders = FULL_HEADERS) -> QuotaExceeded:
    """A TPM QuotaExceeded with ``retry`` seconds."""
    return QuotaExceeded("slow down", metric="tpm", retry_after_s=retry, headers=headers)


@pytest.mark.parametrize(
    ("err", "status", "etype", "code", "param"),
    [
        (BadRequest("bad n", param="n"), 400, "invalid_request_error", "invalid_request", "n"),
        (AuthenticationError("no key"), 401, "invalid_request_error", "invalid_api_key", None),
        (UnknownModel("nope"), 404, "invalid_request_error", "model_not_found", "model"),
        (
            UnknownModel("nope", status=400),
            400,
            "invalid_request_error",
            "model_not_found",
            "model",
        ),
        (PathNotAllowed("no"), 404, "invalid_request_error", "unknown_url", None),
        (RequestTooLarge("big"), 413, "invalid_request_error", "request_too_large", None),
        (LimiterUnavailable("down"), 503, "server_error", "quota_backend_unavailable", None),
        (InternalError("bug"), 500, "server_error", "internal_error", None),
        (quota(1.0), 429, "tokens", "tpm_limit_exceeded", None),
        (
            QuotaExceeded("x", metric="rpm", retry_after_s=1.0, headers=RateLimitHeaders()),
            429,
            "requests",
            "rpm_limit_exceeded",
            None,
        ),
    ],
)
def test_error_body_is_openai_shaped(
    err: GatewayError, status: int, etype: str, code: str, param: str | None
) -> None:
    """Every error renders as {"error": {message, type, param, code}} with its status."""
    body = orjson.loads(error_body(err))
    assert body == {"error": {"message": err.message, "type": etype, "param": param, "code": code}}
    assert err.status == status


def test_error_headers_plain_client_error() -> None:
    """A 400 gets only a JSON content type."""
    assert error_headers(BadRequest("x")) == [("content-type", "application/json")]


def test_error_headers_503_retry_after() -> None:
    """A 503 (limiter down) tells the client to retry after 1 second."""
    assert error_headers(LimiterUnavailable("down")) == [
        ("content-type", "application/json"),
        ("retry-after", "1"),
    ]


def test_quota_headers_complete() -> None:
    """A 429 carries retry-after, retry-after-ms and the six x-ratelimit-* headers."""
    h = dict(error_headers(quota(12.3)))
    assert h == {
        "content-type": "application/json",
        "retry-after": "13",
        "retry-after-ms": "12300",
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "13s",
        "x-ratelimit-limit-tokens": "2000",
        "x-ratelimit-remaining-tokens": "150",
        "x-ratelimit-reset-tokens": "120ms",
    }


@pytest.mark.parametrize(
    ("retry", "seconds", "millis"),
    [
        (0.0, "1", "1"),
        (0.0004, "1", "1"),
        (0.2, "1", "200"),
        (1.0, "1", "1000"),
        (1.001, "2", "1001"),
        (59.5, "60", "59500"),
    ],
)
def test_retry_after_integer_at_least_one_rounded_up(
    retry: float, seconds: str, millis: str
) -> None:
    """retry-after is whole seconds rounded up (at least 1); retry-after-ms likewise in ms."""
    h = dict(error_headers(quota(retry)))
    assert h["retry-after"] == seconds
    assert h["retry-after-ms"] == millis


def test_request_too_large_429_has_no_retry_after() -> None:
    """A 429 without a retry time ('too large') omits retry-after but keeps x-ratelimit-*."""
    names = [n for n, _ in error_headers(quota(None))]
    assert "retry-after" not in names
    assert "retry-after-ms" not in names
    assert "x-ratelimit-limit-tokens" in names


def test_ratelimit_headers_order_and_omission() -> None:
    """Headers come in OpenAI's names; a missing metric's three headers are omitted."""
    only_req = RateLimitHeaders(limit_requests=5, remaining_requests=-3, reset_requests_s=None)
    assert only_req.as_pairs() == [
        ("x-ratelimit-limit-requests", "5"),
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "0s"),
    ]
    assert RateLimitHeaders().as_pairs() == []


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (-5, "0s"),
        (0.12, "120ms"),
        (0.0001, "1ms"),
        (0.9994, "999ms"),
        (1, "1s"),
        (1.5, "2s"),
        (59, "59s"),
        (60, "1m0s"),
        (61, "1m1s"),
        (360, "6m0s"),
        (3599, "59m59s"),
        (3600, "1h0m0s"),
        (3661, "1h1m1s"),
        (86400, "24h0m0s"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    """Durations render like OpenAI's reset headers."""
    assert format_duration(seconds) == text


def test_sse_error_event_single_well_formed_event() -> None:
    """The in-stream error is one SSE data event whose JSON is an OpenAI error object."""
    raw = sse_error_event('quota "gone"\nnow', error_type="tokens", code="tpm_limit_exceeded")
    assert raw.startswith(b"data: ")
    assert raw.endswith(b"\n\n")
    assert raw.count(b"\n") == 2
    dec = SSEDecoder()
    events = dec.feed(raw)
    assert dec.pending_bytes == 0
    assert len(events) == 1
    assert events[0].raw == raw
    assert events[0].data is not None
    assert orjson.loads(events[0].data) == {
        "error": {
            "message": 'quota "gone"\nnow',
            "type": "tokens",
            "param": None,
            "code": "tpm_limit_exceeded",
        }
    }


@given(st.text(max_size=300))
def test_sse_error_event_any_message(message: str) -> None:
    """Any message yields exactly one event whose data parses back to that message."""
    raw = sse_error_event(message, error_type="requests", code="rpm_limit_exceeded")
    events = SSEDecoder().feed(raw)
    assert len(events) == 1
    assert events[0].data is not None
    assert orjson.loads(events[0].data)["error"]["message"] == message


_CUT_FORMATS = ["chat", "completions", "responses", "messages"]


def _cut_bytes(api: str, err: GatewayError) -> bytes:
    from extproc.core.apis.messages import MESSAGES
    from extproc.core.apis.openai import CHAT, COMPLETIONS
    from extproc.core.apis.responses import RESPONSES

    if api == "responses":
        return RESPONSES.cut_events(err, sequence_number=41)
    if api == "messages":
        return MESSAGES.cut_events(err)
    return (CHAT if api == "chat" else COMPLETIONS).cut_events(err)


@pytest.mark.parametrize("api", _CUT_FORMATS)
@given(message=st.text(min_size=1, max_size=200))
def test_cut_event_shape_every_client_reads_as_an_error(api: str, message: str) -> None:
    """Every API's cut: one event named ``error``, a one-line comment with the message, data
    whose error object carries the message, and no [DONE] or other terminator after it."""
    from extproc.errors import StreamCut

    err = StreamCut(message, status=429, error_type="tokens", code="tpm_limit_exceeded")
    raw = _cut_bytes(api, err)
    dec = SSEDecoder()
    events = dec.feed(raw)
    assert dec.pending_bytes == 0 and len(events) == 1
    (ev,) = events
    assert ev.event == "error" and ev.data is not None
    lines = raw.split(b"\n")
    # no terminator event after the error (the message itself may say anything, "[DONE]" too)
    assert b"data: [DONE]" not in lines
    assert lines[0] == b"event: error"
    assert lines[1] == b": " + " ".join(message.split()).encode()  # aiperf's message
    data = orjson.loads(ev.data)
    inner = data["error"]
    assert inner["message"] == message
    assert inner.get("code", "tpm_limit_exceeded") == "tpm_limit_exceeded"
