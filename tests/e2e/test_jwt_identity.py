"""Identity from Envoy's real jwt_authn filter: a token signed with the key of a local JWKS
file names the tenant; a forged or missing token never reaches admission; API keys keep
working beside it (the provider is optional there)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from extproc.envoy_config import JwtAuth
from extproc.stack import Stack
from tests.e2e.conftest import make_stack
from tests.helpers import e2e_rules

pytestmark = pytest.mark.e2e

SECRET = b"test-only-hmac-secret-of-32-bytes!!"
ISSUER = "https://idp.example.test"
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def token(claims: dict[str, object], secret: bytes = SECRET) -> str:
    head = b64(orjson.dumps({"alg": "HS256", "typ": "JWT", "kid": "k1"}))
    body = b64(orjson.dumps({"iss": ISSUER, "exp": int(time.time()) + 600, **claims}))
    sig = hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{b64(sig)}"


@pytest.fixture(scope="module")
def jstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = Path(tmp_path_factory.mktemp("jwt"))
    jwks = work / "jwks.json"
    jwks.write_bytes(
        orjson.dumps({"keys": [{"kty": "oct", "kid": "k1", "alg": "HS256", "k": b64(SECRET)}]})
    )
    rules = e2e_rules()
    rules["identity"] = {
        "sources": ["api_key", "jwt"],
        "jwt": {"tenant_claim": "org", "key_claim": "sub"},
    }
    s = make_stack(
        work, rules=rules, envoy_jwt=JwtAuth(issuer=ISSUER, jwks_path=str(jwks), required=False)
    )
    yield s
    s.stop()


def post(stack: Stack, auth: str | None) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if auth:
        headers["authorization"] = auth
    return httpx.post(
        f"{stack.base_url}/chat/completions",
        headers=headers,
        content=orjson.dumps({"model": "sim-small", "messages": MSG, "max_tokens": 5}),
        timeout=20,
    )


def test_a_verified_token_names_the_tenant(jstack: Stack) -> None:
    r = post(jstack, f"Bearer {token({'org': 't-std', 'sub': 'alice'})}")
    assert r.status_code == 200, r.text
    recs = httpx.get(f"{jstack.sim_url}/sim/requests").json()["requests"]
    assert recs[-1]["tenant"] == "t-std"
    assert recs[-1]["headers_seen"]["x-quota-key"] == "jwt:alice"


def test_a_forged_token_gives_no_identity(jstack: Stack) -> None:
    """jwt_authn rejects the signature, so no payload reaches the processor; the bearer is
    then no known API key either: 401."""
    r = post(jstack, f"Bearer {token({'org': 't-std'}, secret=b'x' * 32)}")
    assert r.status_code == 401
    assert "Incorrect API key" in r.json()["error"]["message"]


def test_a_token_for_an_unknown_tenant_is_403(jstack: Stack) -> None:
    r = post(jstack, f"Bearer {token({'org': 'nobody', 'sub': 'm'})}")
    assert r.status_code == 403
    assert "not configured" in r.json()["error"]["message"]


def test_no_identity_at_all_is_401_json(jstack: Stack) -> None:
    r = post(jstack, None)
    assert r.status_code == 401
    assert "no identity the gateway trusts" in r.json()["error"]["message"]


def test_api_keys_still_work(jstack: Stack) -> None:
    r = post(jstack, "Bearer sk-std")
    assert r.status_code == 200, r.text
