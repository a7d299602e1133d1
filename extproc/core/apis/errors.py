"""Render errors the way OpenAI does: JSON bodies, 429 headers, the in-stream error event.

This is the single place where :mod:`extproc.errors` become bytes and headers.
"""

from __future__ import annotations

import math

import orjson

from extproc.core.admission import (
    describe,
    format_amount,
    human_duration,
    retry_seconds,
    scope_label,
)
from extproc.core.keys import WindowedBucket
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
) -> str:
    """What a client reads when its stream is cut because a quota ran out (``what`` names a
    budget: ``budget of 50.00 USD per month``; empty: tokens per ``per``)."""
    head = (
        f"Budget exhausted on tenant {tenant} ({scope}): {what}"
        if what
        else f"Rate limit reached for tokens per {per} on tenant {tenant} ({scope})"
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
) -> tuple[str, bool]:
    """The cut's message naming the limit that ran out (the per-token bucket furthest past its
    limit in the last charge's answer, else the admitted ones), and whether it is a budget."""
    live = [(b, v) for b, v in charged if b.kind == "tpm" and not b.limit.shadow]
    if not live:
        live = [(b, 0) for b in admitted if b.kind == "tpm" and not b.limit.shadow]
    if not live:
        return "Rate limit reached for tokens; the stream was stopped.", False
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
    )
    return message, budget


def cut_error(reason: str, message: str | None = None, *, budget: bool = False) -> StreamCut:
    """The error a stream cut for ``reason`` (a ``CutReason`` value) carries to the client;
    ``budget``: the quota that ran out is a money or weighted-token budget."""
    if reason == "quota_exhausted":
        return StreamCut(
            message or "Rate limit reached for tokens; the stream was stopped.",
            status=429,
            error_type="budget" if budget else "tokens",
            code="budget_exceeded" if budget else "tpm_limit_exceeded",
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
