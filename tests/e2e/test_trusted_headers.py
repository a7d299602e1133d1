"""The ``header`` identity source on real Envoy: the bootstrap ``ai-quota envoy-config`` renders
removes client-sent identity headers before any other filter, so only a filter placed after
that removal (here a Lua filter standing in for ext_authz) can name the caller
(docs/identity.md)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from extproc.envoy_config import EnvoyPorts, render
from extproc.stack import Stack
from tests.e2e.conftest import make_stack
from tests.helpers import e2e_rules

pytestmark = pytest.mark.e2e

MSG = [{"role": "user", "content": "hi"}]
#: Stands in for ext_authz: a caller who "logs in" with ``x-test-login: rpm`` is tenant t-rpm.
LOGIN = """
function envoy_on_request(handle)
  if handle:headers():get("x-test-login") == "rpm" then
    handle:headers():replace("x-authenticated-tenant", "t-rpm")
    handle:headers():replace("x-authenticated-user", "alice")
  end
end
"""
LUA: dict[str, Any] = {
    "name": "envoy.filters.http.lua",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
        "default_source_code": {"inline_string": LOGIN},
    },
}


@pytest.fixture(scope="module")
def hstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack whose rules trust the identity headers first, then API keys."""
    rules = e2e_rules()
    rules["identity"] = {"sources": ["header", "api_key"]}
    s = make_stack(
        Path(tmp_path_factory.mktemp("trusted")), rules=rules, envoy_identity_filters=(LUA,)
    )
    yield s
    s.stop()


def post(stack: Stack, headers: dict[str, str]) -> httpx.Response:
    body = {"model": "sim-small", "messages": MSG, "max_tokens": 1}
    return httpx.post(f"{stack.base_url}/chat/completions", json=body, headers=headers, timeout=30)


def test_the_removal_is_the_first_filter_and_the_setters_come_after_it() -> None:
    """The rendered chain: header removal, then the identity filters, then ext_proc."""
    cfg = render(EnvoyPorts(trusted_headers=("X-Org", "x-user"), identity_filters=(LUA,)))
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = hcm["typed_config"]["http_filters"]
    names = [f["name"] for f in filters]
    assert names[:2] == ["envoy.filters.http.header_mutation", "envoy.filters.http.lua"]
    assert names.index("envoy.filters.http.ext_proc") > 1
    removed = filters[0]["typed_config"]["mutations"]["request_mutations"]
    assert removed == [{"remove": "x-org"}, {"remove": "x-user"}]


def test_a_client_cannot_name_itself_with_the_identity_header(hstack: Stack) -> None:
    """A client-sent x-authenticated-tenant never reaches the processor: alone it is a 401,
    beside an API key the key decides (t-std's limits, not t-rpm's)."""
    alone = post(hstack, {"x-authenticated-tenant": "t-rpm", "x-authenticated-user": "mallory"})
    assert alone.status_code == 401, alone.text
    with_key = post(hstack, {"authorization": "Bearer sk-std", "x-authenticated-tenant": "t-rpm"})
    assert with_key.status_code == 200, with_key.text
    assert with_key.headers["x-ratelimit-limit-requests"] == "100000"  # plan big, t-std's


def test_a_filter_after_the_removal_names_the_caller(hstack: Stack) -> None:
    """The Lua filter's headers are trusted: no API key needed, t-rpm's limits apply, and a
    client header sent alongside does not override them."""
    r = post(hstack, {"x-test-login": "rpm", "x-authenticated-tenant": "t-std"})
    assert r.status_code == 200, r.text
    assert r.headers["x-ratelimit-limit-requests"] == "2"  # plan rpm2, t-rpm's
