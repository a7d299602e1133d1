"""Response classification: how a response is metered (:func:`classify`) from its status,
its headers and the request's phase."""

from __future__ import annotations

from extproc.core.apis.base import ApiFormat
from extproc.core.encoding import UnsupportedEncoding, decoder_for, is_json, media_type
from extproc.core.lifecycle import State
from extproc.core.phase_records import Admitted, Metering, Parsed

# Media types that are streams but not SSE: the meter cannot read them.
UNMETERABLE_STREAMS = ("application/x-ndjson", "application/jsonl", "application/json-seq")


def parse_status(headers: dict[str, str]) -> int:
    """The ``:status`` pseudo-header as a number (0 when it is missing or not a number)."""
    try:
        return int(headers.get(":status", "0"))
    except ValueError:
        return 0


def classify(
    headers: dict[str, str],
    before: State,
    *,
    parsed: Parsed | None,
    admitted: Admitted | None,
    api: ApiFormat | None,
    end_of_stream: bool,
) -> Metering:
    """How a response is metered, from its status and headers and the request's phase."""
    status = parse_status(headers)
    if before in (State.AWAIT_HEADERS, State.AWAIT_BODY):
        return Metering("local_reply")
    cost = admitted.cost if admitted is not None else None
    if cost is None or parsed is None or api is None:
        return Metering("unmetered")
    if not 200 <= status < 300:
        return Metering("upstream_error")
    ctype = headers.get("content-type", "")
    try:
        decoder = decoder_for(headers.get("content-encoding", ""))
    except UnsupportedEncoding:
        return Metering(
            "unmeterable", reason=f"content-encoding {headers.get('content-encoding', '')[:40]}"
        )
    if parsed.req.stream and api.can_stream and cost.meter_stream and not is_json(ctype):
        if media_type(ctype) in UNMETERABLE_STREAMS:
            return Metering("unmeterable", reason=f"content-type {media_type(ctype)}")
        return Metering("stream", decoder)
    if (
        cost.upstream_stream
        and not end_of_stream
        and not is_json(ctype)
        and media_type(ctype) not in UNMETERABLE_STREAMS
    ):
        # a non-stream the gateway sent upstream as a stream (the exact path): kept as it
        # passes, its JSON rebuilt for the client; an upstream that answered it with JSON
        # anyway (it cannot stream) is read as JSON below
        return Metering("exact", decoder)
    if cost.settle_to_actual and not end_of_stream:
        return Metering("read_json", decoder)
    return Metering("done")
