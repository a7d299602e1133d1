"""Render errors the way OpenAI does: JSON bodies, 429 headers, the in-stream error event.

This is the single place where :mod:`extproc.errors` become bytes and headers.
"""

from __future__ import annotations

import math

import orjson

from extproc.errors import ErrorBody, GatewayError, QuotaExceeded


def error_body(err: GatewayError) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}`` for ``err``."""
    return orjson.dumps(ErrorBody(err.message, err.error_type, err.code, err.param).as_dict())


def error_headers(err: GatewayError) -> list[tuple[str, str]]:
    """Headers of the immediate response for ``err`` (content type, retry-after, x-ratelimit-*)."""
    out = [("content-type", "application/json")]
    if isinstance(err, QuotaExceeded):
        if err.retry_after_s is not None:
            out.append(("retry-after", str(max(1, math.ceil(err.retry_after_s)))))
            out.append(("retry-after-ms", str(max(1, math.ceil(err.retry_after_s * 1000)))))
        out += err.headers.as_pairs()
    elif err.status == 503:
        out.append(("retry-after", "1"))
    return out


def sse_error_event(message: str, *, error_type: str, code: str) -> bytes:
    """One SSE event carrying an OpenAI error object (what the SDKs raise as ``APIError``)."""
    body = ErrorBody(message, error_type, code).as_dict()
    return b"data: " + orjson.dumps(body) + b"\n\n"
