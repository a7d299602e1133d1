"""The response side's decisions, pure of Envoy messages: how a response is metered, chosen from
its status and headers, and what a JSON body says it used."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from extproc.core.encoding import UnsupportedEncoding, decoder_for, is_json, media_type
from extproc.core.lifecycle import State
from extproc.server.context import RequestContext
from extproc.server.gateway import Gateway
from extproc.server.settle import bounded_usage

# Media types that are streams but not SSE: the meter cannot read them.
UNMETERABLE_STREAMS = ("application/x-ndjson", "application/jsonl", "application/json-seq")

Kind = Literal[
    "local_reply", "unmetered", "upstream_error", "unmeterable", "stream", "read_json", "done"
]


@dataclass(frozen=True, slots=True)
class Metering:
    """How a response is handled: ``kind``, the body's decoder, why it cannot be metered."""

    kind: Kind
    decoder: Any = None
    reason: str = ""


def classify(
    ctx: RequestContext, h: dict[str, str], before: State, *, end_of_stream: bool
) -> Metering:
    """The response's metering from its status and headers (sets ``ctx.status``)."""
    try:
        ctx.status = int(h.get(":status", "0"))
    except ValueError:
        ctx.status = 0
    if before in (State.AWAIT_HEADERS, State.AWAIT_BODY):
        return Metering("local_reply")
    if not ctx.metered:
        return Metering("unmetered")
    cost, req, api = ctx.cost, ctx.req, ctx.api
    assert cost is not None and req is not None and api is not None
    if not 200 <= ctx.status < 300:
        return Metering("upstream_error")
    ctype = h.get("content-type", "")
    try:
        decoder = decoder_for(h.get("content-encoding", ""))
    except UnsupportedEncoding:
        return Metering(
            "unmeterable", reason=f"content-encoding {h.get('content-encoding', '')[:40]}"
        )
    if req.stream and api.can_stream and cost.meter_stream and not is_json(ctype):
        if media_type(ctype) in UNMETERABLE_STREAMS:
            return Metering("unmeterable", reason=f"content-type {media_type(ctype)}")
        return Metering("stream", decoder)
    if cost.settle_to_actual and not end_of_stream:
        return Metering("read_json", decoder)
    return Metering("done")


def read_json_usage(gw: Gateway, ctx: RequestContext, raw: bytes, decoder: Any) -> None:
    """Take a complete JSON body's ``usage`` into the context (within the trusted bounds)."""
    assert ctx.api is not None
    try:
        plain = decoder.feed(raw) + decoder.flush() if decoder is not None else raw
    except Exception:  # noqa: BLE001 - a corrupt body has no usage to read
        plain = b""
    usage = ctx.api.json_usage(plain)
    if usage is not None:
        ctx.usage_output = bounded_usage(gw, ctx, usage.completion_tokens, 0)
        ctx.usage_input = usage.prompt_tokens
        ctx.usage_cached_input = usage.cached_input_tokens
        ctx.usage_reasoning = usage.reasoning_tokens
