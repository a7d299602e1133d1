"""Identity from what Envoy already knows: a JWT payload its jwt_authn filter verified
(forwarded as ext_proc metadata) or headers an earlier filter set; the gateway's own keys keep
working beside them; a client-sent header alone never counts when the source is off."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from google.protobuf import struct_pb2

from tests.integration.test_servicer_inprocess import (
    Call,
    Served,
    immediate,
    req_headers,
    serve,
    set_headers,
)

pytestmark = pytest.mark.integration

RULES = """
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 1000}
plans:
  p: {limits: [{model: "*", per: minute, rpm: 100, tpm: 100000}]}
tenants:
  acme: {plan: p, keys: [{name: k, plaintext: sk-acme}]}
  globex: {plan: p}
identity:
  sources: [%s]
  jwt: {tenant_claim: org.id, key_claim: sub, tenant_map: {org-42: globex}}
"""


@pytest.fixture
async def srv(request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    async for s in serve(rules=RULES % request.param):
        yield s


def with_jwt(msg: Any, payload: dict[str, Any]) -> Any:
    s = struct_pb2.Struct()
    s.update({"jwt_payload": payload})
    msg.metadata_context.filter_metadata["envoy.filters.http.jwt_authn"].CopyFrom(s)
    return msg


@pytest.mark.parametrize("srv", ["api_key, jwt"], indirect=True)
async def test_jwt_claims_name_the_tenant_and_key(srv: Served) -> None:
    c = Call(srv.stub)
    msg = with_jwt(req_headers(key=""), {"sub": "user-7", "org": {"id": "acme"}})
    [r] = await c.send(msg)
    h = set_headers(r, "request_headers")
    assert (h["x-quota-tenant"], h["x-quota-key"]) == ("acme", "jwt:user-7")


@pytest.mark.parametrize("srv", ["api_key, jwt"], indirect=True)
async def test_jwt_tenant_map_and_unknown_tenant(srv: Served) -> None:
    c = Call(srv.stub)
    [r] = await c.send(with_jwt(req_headers(key=""), {"sub": "u", "org": {"id": "org-42"}}))
    assert set_headers(r, "request_headers")["x-quota-tenant"] == "globex"
    c2 = Call(srv.stub)
    [r2] = await c2.send(with_jwt(req_headers(key=""), {"sub": "u", "org": {"id": "nobody"}}))
    status, body, _ = immediate(r2)
    assert status == 403 and "not configured" in body["error"]["message"]


@pytest.mark.parametrize("srv", ["api_key, jwt"], indirect=True)
async def test_own_keys_still_work_and_no_identity_is_401(srv: Served) -> None:
    c = Call(srv.stub)
    [r] = await c.send(req_headers(key="sk-acme"))
    assert set_headers(r, "request_headers")["x-quota-tenant"] == "acme"
    c2 = Call(srv.stub)
    [r2] = await c2.send(req_headers(key=""))
    status, body, _ = immediate(r2)
    assert status == 401 and "no identity the gateway trusts" in body["error"]["message"]


@pytest.mark.parametrize("srv", ["api_key, jwt"], indirect=True)
async def test_client_sent_identity_header_does_not_count_without_the_header_source(
    srv: Served,
) -> None:
    c = Call(srv.stub)
    [r] = await c.send(req_headers(key="", **{"x-authenticated-tenant": "acme"}))
    assert immediate(r)[0] == 401


@pytest.mark.parametrize("srv", ["header"], indirect=True)
async def test_trusted_header_source(srv: Served) -> None:
    c = Call(srv.stub)
    [r] = await c.send(
        req_headers(key="", **{"x-authenticated-tenant": "globex", "x-authenticated-user": "bob"})
    )
    h = set_headers(r, "request_headers")
    assert (h["x-quota-tenant"], h["x-quota-key"]) == ("globex", "header:bob")
