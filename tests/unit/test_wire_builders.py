"""The reply builders of :mod:`extproc.server.wire` set leaf fields in place (issue 27: a third
of the constructors' CPU); every message must be the one the nested constructors build, byte
for byte, empty header mutations and metadata of every value type included."""

from __future__ import annotations

from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from extproc.server import wire

pytestmark = pytest.mark.unit

HEADERS = [("x-ratelimit-remaining-tokens", "999"), ("x-note", "é ü")]
META: dict[str, object] = {
    "tenant": "t-1",
    "input_tokens": 1004,
    "share": 0.5,
    "cut": True,
    "ok": False,
    "none": None,
    "other": ("a", 1),
}


def _mutation(set_headers: list[tuple[str, str]], remove: tuple[str, ...] = ()) -> Any:
    return pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for k, v in set_headers
        ],
        remove_headers=list(remove),
    )


def _metadata(values: dict[str, object]) -> Any:
    inner = struct_pb2.Struct()
    for k, v in values.items():
        if isinstance(v, bool):
            inner.fields[k].bool_value = v
        elif isinstance(v, int | float):
            inner.fields[k].number_value = float(v)
        elif v is None:
            inner.fields[k].null_value = struct_pb2.NULL_VALUE
        else:
            inner.fields[k].string_value = str(v)
    s = struct_pb2.Struct()
    s.fields[wire.METADATA_NAMESPACE].struct_value.CopyFrom(inner)
    return s


def _same(got: Any, want: Any) -> None:
    assert got == want
    assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)


@pytest.mark.parametrize("headers", [[], HEADERS])
@pytest.mark.parametrize("remove", [(), ("x-aiq-tenant", "accept-encoding")])
@pytest.mark.parametrize("mode", [None, wire.passthrough_mode()])
def test_request_headers_reply(
    headers: list[tuple[str, str]], remove: tuple[str, ...], mode: Any
) -> None:
    """CONTINUE at request headers: the mutation present even when empty, the mode kept."""
    want = pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=_mutation(headers, remove))
        )
    )
    if mode is not None:
        want.mode_override.CopyFrom(mode)
    _same(wire.continue_request_headers(headers, remove, mode=mode), want)


@pytest.mark.parametrize("body", [None, b"", b'{"model":"m"}'])
def test_request_body_reply(body: bytes | None) -> None:
    """CONTINUE at the request body, with a replaced body and its content-length."""
    common = pb.CommonResponse()
    if body is not None:
        common.body_mutation.body = body
        common.header_mutation.CopyFrom(_mutation([("content-length", str(len(body)))]))
    want = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
    _same(wire.continue_request_body(body), want)


@pytest.mark.parametrize("headers", [[], HEADERS])
@pytest.mark.parametrize("meta", [None, {}, META])
@pytest.mark.parametrize("mode", [None, wire.streamed_mode(), wire.full_duplex_mode()])
def test_response_headers_reply(
    headers: list[tuple[str, str]], meta: dict[str, object] | None, mode: Any
) -> None:
    """CONTINUE at response headers: rate-limit headers, removals, mode and metadata."""
    remove = ("content-length",)
    want = pb.ProcessingResponse(
        response_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=_mutation(headers, remove))
        )
    )
    if mode is not None:
        want.mode_override.CopyFrom(mode)
    if meta:
        want.dynamic_metadata.CopyFrom(_metadata(meta))
    _same(wire.continue_response_headers(headers, remove=remove, mode=mode, metadata=meta), want)


@pytest.mark.parametrize("meta", [None, META])
def test_response_body_and_immediate_replies(meta: dict[str, object] | None) -> None:
    """CONTINUE for a response body chunk, and an immediate response, with metadata."""
    want = pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse()))
    if meta:
        want.dynamic_metadata.CopyFrom(_metadata(meta))
    _same(wire.continue_response_body(meta), want)
    want = pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=429),
            headers=_mutation(HEADERS),
            body=b"{}",
            details="ai_quota_tpm_limit_exceeded",
        )
    )
    if meta:
        want.dynamic_metadata.CopyFrom(_metadata(meta))
    _same(wire.immediate(429, HEADERS, b"{}", "ai_quota_tpm_limit_exceeded", meta), want)


def test_dynamic_metadata_of_every_value_type() -> None:
    """Strings, ints, floats, bools (never numbers), None and anything else as its str."""
    _same(wire.dynamic_metadata(META), _metadata(META))
    fields = wire.dynamic_metadata(META).fields[wire.METADATA_NAMESPACE].struct_value.fields
    assert fields["cut"].WhichOneof("kind") == "bool_value"
    assert fields["input_tokens"].number_value == 1004.0
    assert fields["other"].string_value == "('a', 1)"
