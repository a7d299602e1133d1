"""ProcessingRequest/ProcessingResponse helpers (Envoy ext_proc v3, from ``xds-protos``).

The only module that builds Envoy protobuf messages; everything else speaks plain Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeAlias

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import json_format, struct_pb2

# The generated classes are untyped for mypy; these aliases keep signatures readable.
ProcessingRequest: TypeAlias = Any
ProcessingResponse: TypeAlias = Any
Mode: TypeAlias = Any
_PR = pb.ProcessingResponse
_Body = pb.BodyResponse
_Common = pb.CommonResponse
_Mutation = pb.BodyMutation
_Streamed = pb.StreamedBodyResponse
_Mode = processing_mode_pb2.ProcessingMode

METADATA_NAMESPACE = "ai_quota"


def override_message_timeout(ms: int) -> ProcessingResponse:
    """Ask Envoy for ``ms`` more on the message it waits on (a request held for its turn:
    ``max_message_timeout`` must allow it; Envoy takes one override per message)."""
    r = _PR()
    r.override_message_timeout.FromMilliseconds(ms)
    return r


def headers_of(hh: Any) -> dict[str, str]:
    """Header map with lower-case names (values from ``raw_value``; Envoy leaves ``value`` empty)."""
    out: dict[str, str] = {}
    for h in hh.headers.headers:
        raw = h.raw_value  # read once: each field read of a upb message is a lookup
        out[h.key.lower()] = raw.decode("utf-8", "replace") if raw else h.value
    return out


def metadata_of(req: Any) -> dict[str, Any]:
    """The dynamic metadata Envoy forwarded (``metadata_options``), namespace -> plain dict."""
    if req is None or not req.HasField("metadata_context"):
        return {}
    fm = req.metadata_context.filter_metadata
    return {ns: json_format.MessageToDict(fm[ns]) for ns in fm}


_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _fill_mutation(
    m: Any, set_headers: Iterable[tuple[str, str]] = (), remove: Iterable[str] = ()
) -> None:
    """Fill the HeaderMutation ``m`` in place (hot path: every request's replies carry one).

    Leaf fields are set on messages ``add()`` creates: about a third of the cost of building
    each ``HeaderValueOption`` and its ``HeaderValue`` by constructor; the same bytes.
    """
    m.SetInParent()  # present even when empty, as a constructor-built one is
    add = m.set_headers.add
    for k, v in set_headers:
        opt = add()
        h = opt.header
        h.key = k
        h.raw_value = v.encode()
        opt.append_action = _OVERWRITE
    if remove:
        m.remove_headers.extend(remove)


def _mutation(set_headers: Iterable[tuple[str, str]] = (), remove: Iterable[str] = ()) -> Any:
    m = pb.HeaderMutation()
    _fill_mutation(m, set_headers, remove)
    return m


def continue_request_headers(
    set_headers: Iterable[tuple[str, str]] = (),
    remove: Iterable[str] = (),
    mode: Mode | None = None,
) -> ProcessingResponse:
    """CONTINUE at request headers, with our identity headers set and client ones removed."""
    r = _PR()
    common = r.request_headers.response
    common.SetInParent()
    _fill_mutation(common.header_mutation, set_headers, remove)
    if mode is not None:
        r.mode_override.CopyFrom(mode)
    return r


def continue_request_body(new_body: bytes | None) -> ProcessingResponse:
    """CONTINUE at request body; with a replaced body and its content-length when mutated."""
    r = _PR()
    common = r.request_body.response
    common.SetInParent()
    if new_body is not None:
        common.body_mutation.body = new_body
        _fill_mutation(common.header_mutation, [("content-length", str(len(new_body)))])
    return r


def continue_response_headers(
    set_headers: Iterable[tuple[str, str]] = (),
    *,
    remove: Iterable[str] = (),
    mode: Mode | None = None,
    metadata: Mapping[str, object] | None = None,
) -> ProcessingResponse:
    """CONTINUE at response headers, adding ``x-ratelimit-*`` and maybe switching body mode."""
    r = _PR()
    common = r.response_headers.response
    common.SetInParent()
    _fill_mutation(common.header_mutation, set_headers, remove)
    if mode is not None:
        r.mode_override.CopyFrom(mode)
    if metadata:
        _fill_metadata(r.dynamic_metadata, metadata)
    return r


def full_duplex_mode() -> Mode:
    """Response body FULL_DUPLEX_STREAMED with trailers SEND (Envoy requires both together)."""
    return _Mode(
        response_body_mode=_Mode.FULL_DUPLEX_STREAMED,
        response_trailer_mode=_Mode.SEND,
    )


def streamed_mode() -> Mode:
    """Response body STREAMED: chunks pass through us (to read a JSON response's usage)."""
    return _Mode(response_body_mode=_Mode.STREAMED)


def passthrough_mode() -> Mode:
    """Stop sending this request's body and response to the processor."""
    return _Mode(
        request_body_mode=_Mode.NONE,
        response_header_mode=_Mode.SKIP,
        response_body_mode=_Mode.NONE,
    )


def continue_response_body(metadata: Mapping[str, object] | None = None) -> ProcessingResponse:
    """CONTINUE for a STREAMED response body chunk."""
    r = _PR()
    r.response_body.response.SetInParent()
    if metadata:
        _fill_metadata(r.dynamic_metadata, metadata)
    return r


def streamed_body(
    data: bytes, end_of_stream: bool, metadata: Mapping[str, object] | None = None
) -> ProcessingResponse:
    """A FULL_DUPLEX_STREAMED body response: bytes we forward to the client (hot path).

    Built by setting the leaf fields of an empty message (upb creates the parents on the
    way): a quarter of the cost of the nested constructor calls, the same bytes on the wire.
    """
    r = _PR()
    sr = r.response_body.response.body_mutation.streamed_response
    sr.body = data
    if end_of_stream:
        sr.end_of_stream = True
    if metadata:
        _fill_metadata(r.dynamic_metadata, metadata)
    return r


def continue_response_trailers() -> ProcessingResponse:
    """Let response trailers through unchanged."""
    return _PR(response_trailers=pb.TrailersResponse())


def continue_request_trailers() -> ProcessingResponse:
    """Let request trailers through unchanged."""
    return _PR(request_trailers=pb.TrailersResponse())


def immediate(
    status: int,
    headers: Iterable[tuple[str, str]],
    body: bytes,
    details: str,
    metadata: Mapping[str, object] | None = None,
) -> ProcessingResponse:
    """Answer the client now (401, 400, 429, 503...) without reaching the upstream."""
    r = _PR(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=_mutation(headers),
            body=body,
            details=details,
        )
    )
    if metadata:
        _fill_metadata(r.dynamic_metadata, metadata)
    return r


def dynamic_metadata(values: Mapping[str, object]) -> Any:
    """``{ai_quota: {...}}`` for ``%DYNAMIC_METADATA(ai_quota:field)%`` in access logs."""
    s = struct_pb2.Struct()
    _fill_metadata(s, values)
    return s


def _fill_metadata(s: Any, values: Mapping[str, object]) -> None:
    """Write :func:`dynamic_metadata`'s fields into the Struct ``s`` (a reply's own field:
    no copy).  Exact types first (the common cases), then the general rule."""
    fields = s.fields[METADATA_NAMESPACE].struct_value.fields
    for k, v in values.items():
        t = type(v)
        if t is str:
            fields[k].string_value = v
        elif t is int or t is float:
            fields[k].number_value = float(v)  # type: ignore[arg-type]
        elif t is bool or isinstance(v, bool):
            fields[k].bool_value = v
        elif isinstance(v, int | float):
            fields[k].number_value = float(v)
        elif v is None:
            fields[k].null_value = struct_pb2.NULL_VALUE
        else:
            fields[k].string_value = str(v)
