"""Render errors the way each API does: JSON bodies, 429 headers, the in-stream error event
(OpenAI's for chat, completions, Responses and embeddings; Anthropic's for Messages).

This is the single place where :mod:`extproc.errors` become bytes and headers; the codecs
(:mod:`extproc.core.apis`) call it.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any, Final

import orjson

from extproc.core.admission_plan import (
    describe,
    format_amount,
    human_duration,
    retry_seconds,
    scope_label,
)
from extproc.core.keys import WindowedBucket
from extproc.core.levels import level_label
from extproc.core.rules import Limit
from extproc.errors import ErrorBody, GatewayError, QuotaExceeded, StreamCut


def error_body(err: GatewayError) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}`` for ``err``."""
    return orjson.dumps(ErrorBody(err.message, err.error_type, err.code, err.param).as_dict())


def error_headers(err: GatewayError) -> list[tuple[str, str]]:
    """Headers of the immediate response for ``err`` (content type, retry-after, x-ratelimit-*)."""
    out = [("content-type", "application/json")]
    if isinstance(err, QuotaExceeded):
        if err.retry_after_s is not None:
            out.append(("retry-after", str(retry_seconds(err.retry_after_s))))
            out.append(("retry-after-ms", str(max(1, math.ceil(err.retry_after_s * 1000)))))
        out += err.headers.as_pairs()
        if err.level:
            out.append(("x-aiquota-limit-level", err.level))
    elif err.status == 503:
        out.append(("retry-after", "1"))
    return out


def sse_error_event(message: str, *, error_type: str, code: str) -> bytes:
    """One SSE event carrying an OpenAI error object (what the SDKs raise as ``APIError``)."""
    body = ErrorBody(message, error_type, code).as_dict()
    return b"data: " + orjson.dumps(body) + b"\n\n"


def sse_cut_event(data: object, message: str) -> bytes:
    """The event that ends a cut stream, in every API: ``event: error``, a comment line with the
    message on one line, then ``data`` as JSON.

    Each part is there for a client that reads only that part: the openai and anthropic SDKs
    raise on the data's error object (the openai SDK for ``data: {"error": ...}`` with or
    without an event name), GuideLLM on a data line with ``error``, aiperf on any event named
    ``error`` (it reports the event's first comment as the message), and SSE parsers skip
    comments.  Nothing follows it: no ``data: [DONE]``, and the gateway then aborts the HTTP
    response (see ``extproc.server.stream``), the only signal inference-perf reads."""
    comment = " ".join(message.split()).encode()
    return b"event: error\n: " + comment + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def openai_cut_event(err: GatewayError) -> bytes:
    """The event that ends a cut chat or completions stream: ``event: error`` with the OpenAI
    error object, and no ``data: [DONE]`` after it."""
    return sse_cut_event(
        ErrorBody(err.message, err.error_type, err.code, err.param).as_dict(), err.message
    )


def responses_cut_event(err: GatewayError, *, sequence_number: int | None = None) -> bytes:
    """The Responses stream's ``error`` event: top-level ``type: "error"``, ``code``,
    ``message``, ``param`` and ``sequence_number`` (one past ``sequence_number``, else 0), and
    an ``error`` object with the same message (the openai SDK raises on it)."""
    seq = 0 if sequence_number is None else sequence_number + 1
    inner = ErrorBody(err.message, err.error_type, err.code, err.param).as_dict()["error"]
    data = {
        "type": "error",
        "code": err.code,
        "message": err.message,
        "param": err.param,
        "sequence_number": seq,
        "error": inner,
    }
    return sse_cut_event(data, err.message)


def quota_cut_message(
    *,
    tenant: str,
    per: str,
    scope: str,
    limit: int | str,
    used: int | str,
    delivered: int,
    reset_s: float,
    what: str = "",
    on: str = "",
) -> str:
    """What a client reads when its stream is cut because a quota ran out (``what`` names a
    budget: ``budget of 50.00 USD per month``; empty: tokens per ``per``; ``on`` the level
    that ran out, ``organisation acme``: by default the tenant)."""
    on = on or f"tenant {tenant}"
    head = (
        f"Budget exhausted on {on} ({scope}): {what}"
        if what
        else f"Rate limit reached for tokens per {per} on {on} ({scope})"
    )
    resets = human_duration(reset_s) if what else f"{retry_seconds(reset_s)}s"
    return (
        f"{head}: limit {limit}, used {used}. The stream was stopped after {delivered} output "
        f"tokens; the limit resets in {resets}."
    )


def quota_cut(
    *,
    tenant: str,
    charged: list[tuple[WindowedBucket, int]],
    admitted: list[WindowedBucket],
    delivered: int,
    now_ms: int,
) -> tuple[str, bool, Limit | None]:
    """The cut's message naming the limit that ran out (the per-token bucket furthest past its
    limit in the last charge's answer, else the admitted ones), whether it is a budget, and
    that limit (None: none is known)."""
    live = [(b, v) for b, v in charged if b.kind == "tpm" and not b.limit.shadow]
    if not live:
        live = [(b, 0) for b in admitted if b.kind == "tpm" and not b.limit.shadow]
    if not live:
        return "Rate limit reached for tokens; the stream was stopped.", False, None
    b, v = max(live, key=lambda bv: (bv[1] - bv[0].limit.limit) / max(1, bv[0].limit.limit))
    used = v if v else b.limit.limit
    budget = b.metric == "cost"
    message = quota_cut_message(
        tenant=tenant,
        per=b.limit.period_name,
        scope=scope_label(b.limit),
        limit=format_amount(b.limit, b.limit.limit) if budget else b.limit.limit,
        used=format_amount(b.limit, used) if budget else used,
        delivered=delivered,
        reset_s=b.reset_s(now_ms),
        what=describe(b.limit) if budget else "",
        on=level_label(b, tenant),
    )
    return message, budget, b.limit


def cut_error(
    reason: str,
    message: str | None = None,
    *,
    budget: bool = False,
    limit: Limit | None = None,
) -> StreamCut:
    """The error a stream cut for ``reason`` (a ``CutReason`` value) carries to the client;
    ``budget``: the quota that ran out is a money or weighted-token budget."""
    if reason == "quota_exhausted":
        return StreamCut(
            message or "Rate limit reached for tokens; the stream was stopped.",
            status=429,
            error_type="budget" if budget else "tokens",
            code="budget_exceeded" if budget else "tpm_limit_exceeded",
            limit=limit,
        )
    if reason == "quota_backend_unavailable":
        text = "The quota backend is unavailable; the stream was stopped. Retry shortly."
        return StreamCut(text, status=503, error_type="server_error", code=reason)
    if reason == "upstream_event_too_large":
        text = "The upstream sent an SSE event larger than the gateway accepts; the stream was stopped."
        return StreamCut(text, status=502, error_type="server_error", code=reason)
    if reason == "server_shutdown":
        text = "The gateway is restarting; the stream was stopped. Retry the request."
        return StreamCut(text, status=503, error_type="server_error", code=reason)
    text = message or "The upstream response could not be metered; the stream was stopped."
    return StreamCut(text, status=502, error_type="server_error", code=reason)


# -- Anthropic (the Messages API) ---------------------------------------------------------

#: Anthropic's error ``type`` for an HTTP status (others: ``api_error`` from 500 up,
#: ``invalid_request_error`` below).
ANTHROPIC_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status."""
    known = ANTHROPIC_ERROR_TYPES.get(status)
    if known is not None:
        return known
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error_object(err: GatewayError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` for ``err``."""
    return {
        "type": "error",
        "error": {"type": anthropic_error_type(err.status), "message": err.message},
    }


def anthropic_error_body(err: GatewayError) -> bytes:
    """The JSON body of an immediate Anthropic-shaped error response."""
    return orjson.dumps(anthropic_error_object(err))


def anthropic_cut_event(err: GatewayError) -> bytes:
    """The event that ends a cut Messages stream: ``event: error`` with the Anthropic error
    object (the SDKs raise on it); nothing follows (no ``message_stop``, no ``[DONE]``)."""
    return sse_cut_event(anthropic_error_object(err), err.message)


def rfc3339(epoch_s: float) -> str:
    """``2024-05-01T12:00:41Z`` for a Unix time (rounded up to the second)."""
    instant = dt.datetime.fromtimestamp(math.ceil(epoch_s), tz=dt.UTC)
    return instant.strftime("%Y-%m-%dT%H:%M:%SZ")


def anthropic_error_headers(err: GatewayError, *, now_ms: int | None) -> list[tuple[str, str]]:
    """Content type; on a 429 ``retry-after`` and the ``anthropic-ratelimit-*`` headers
    (``*-reset`` only when ``now_ms`` is given); on a 503 ``retry-after: 1``."""
    out = [("content-type", "application/json")]
    if isinstance(err, QuotaExceeded):
        if err.retry_after_s is not None:
            out.append(("retry-after", str(retry_seconds(err.retry_after_s))))
        out += _anthropic_ratelimit_headers(err, now_ms)
        if err.level:
            out.append(("x-aiquota-limit-level", err.level))
    elif err.status == 503:
        out.append(("retry-after", "1"))
    return out


def _anthropic_ratelimit_headers(err: QuotaExceeded, now_ms: int | None) -> list[tuple[str, str]]:
    h = err.headers
    families: list[tuple[tuple[str, ...], int | None, int | None, float | None]] = [
        (("requests",), h.limit_requests, h.remaining_requests, h.reset_requests_s),
        (
            ("tokens", "input-tokens", "output-tokens"),
            h.limit_tokens,
            h.remaining_tokens,
            h.reset_tokens_s,
        ),
    ]
    out: list[tuple[str, str]] = []
    for names, limit, remaining, reset_s in families:
        if limit is None:
            continue
        for name in names:
            prefix = f"anthropic-ratelimit-{name}"
            out.append((f"{prefix}-limit", str(limit)))
            out.append((f"{prefix}-remaining", str(max(0, remaining or 0))))
            if now_ms is not None:
                out.append((f"{prefix}-reset", rfc3339(now_ms / 1000 + (reset_s or 0.0))))
    return out


def passed_error(err: object) -> dict[str, object]:
    """An upstream's own error object, found in a stream the gateway reassembles (the exact
    path), as the OpenAI-shaped body a non-streaming upstream would have answered."""
    return {"error": err}


def passed_anthropic_error(err: object) -> dict[str, object]:
    """The same for the Messages API: ``{"type": "error", "error": ...}``."""
    return {"type": "error", "error": err}
