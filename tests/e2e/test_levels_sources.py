"""Levels through the real stack, for what tests/e2e/test_levels.py leaves out: end users named
by Anthropic's ``metadata.user_id``, by a configured header and by a claim of the verified JWT
(Envoy's real jwt_authn filter), each refused near its per-user limit while another user goes
on, and a client-chosen id that cannot name itself out of a header or JWT source; and an RLS
descriptor naming an organisation or a team, counted by the running RLS service in the very
counter the gateway's admissions charge.

Every window is a day (no minute boundary inside a test); each end user's limit is 300
tokens a day and a request is about 75."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
import redis
from envoy.service.ratelimit.v3 import rls_pb2_grpc

from extproc.envoy_config import JwtAuth
from extproc.stack import Stack
from tests.e2e.conftest import caller_metadata, grpc_channel, make_stack
from tests.e2e.test_jwt_identity import ISSUER, SECRET, b64, token
from tests.e2e.test_streaming import MSG
from tests.helpers import request_ledgers
from tests.rls_support import OK, OVER, request

pytestmark = pytest.mark.e2e

USER_TPM = 300  # each end user's tokens a day
RLS_ORG_TPM = 5000  # organisation ro's tokens a day (the RLS rule's requests_per_unit too)
RLS_TEAM_TPM = 4000


def rules(sources: list[str]) -> dict[str, Any]:
    """Organisation eo / team et (end users 300 tokens a day each) with tenant e (key sk-eu),
    and organisation ro / team rt with tenant r (key sk-ro) for the RLS test."""
    day = "day"
    return {
        "version": 1,
        "charging": {"charge_every_tokens": 16},
        "models": {
            "sim-small": {
                "tokenizer": {"kind": "tiktoken", "encoding": "cl100k_base"},
                "max_output_tokens": 1024,
            }
        },
        "plans": {"big": {"limits": [{"per": day, "rpm": 100000, "tpm": 1_000_000}]}},
        "organisations": {
            "eo": {"limits": [{"per": day, "tpm": 1_000_000}]},
            "ro": {"limits": [{"per": day, "tpm": RLS_ORG_TPM}]},
        },
        "teams": {
            "et": {
                "organisation": "eo",
                "limits": [{"per": day, "tpm": 1_000_000}],
                "end_users": {"limits": [{"per": day, "tpm": USER_TPM}], "per": day},
            },
            "rt": {"organisation": "ro", "limits": [{"per": day, "tpm": RLS_TEAM_TPM}]},
        },
        "tenants": {
            "e": {"plan": "big", "team": "et", "keys": [{"name": "k", "plaintext": "sk-eu"}]},
            "r": {"plan": "big", "team": "rt", "keys": [{"name": "k", "plaintext": "sk-ro"}]},
        },
        "end_users": {"sources": sources},
        "identity": {
            "sources": ["api_key", "jwt"],
            "jwt": {"tenant_claim": "org", "key_claim": "sub"},
        },
    }


RLS_CONFIG = f"""domain: levels
descriptors:
  - key: org
    ai_quota: {{bucket: tpm, organisation: org}}
    rate_limit: {{unit: day, requests_per_unit: {RLS_ORG_TPM}}}
  - key: team
    ai_quota: {{bucket: tpm, team: team}}
    rate_limit: {{unit: day, requests_per_unit: {RLS_TEAM_TPM}}}
"""


def start(work: Path, sources: list[str]) -> Stack:
    jwks = work / "jwks.json"
    jwks.write_bytes(
        orjson.dumps({"keys": [{"kty": "oct", "kid": "k1", "alg": "HS256", "k": b64(SECRET)}]})
    )
    rls = work / "rls"
    rls.mkdir()
    (rls / "levels.yaml").write_text(RLS_CONFIG)
    return make_stack(
        work,
        rules=rules(sources),
        envoy_jwt=JwtAuth(issuer=ISSUER, jwks_path=str(jwks), required=False),
        extproc_env={"AIQ_RLS_CONFIG": str(rls)},
    )


@pytest.fixture(scope="module")
def body_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """End users named by the body (the default source): ``user`` / ``metadata.user_id``."""
    s = start(Path(tmp_path_factory.mktemp("levels-body")), ["body"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def trusted_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """End users named by the verified JWT's ``user`` claim, else the ``x-end-user`` header;
    the body is no source."""
    s = start(Path(tmp_path_factory.mktemp("levels-trusted")), ["jwt", "header"])
    yield s
    s.stop()


def used(rds: redis.Redis, org: str, scope: str, metric: str = "tpm") -> int:
    """The day's counter of one level of ``org`` (``o``, ``g.et``, ``u.et.h1``)."""
    return sum(int(rds.get(k) or 0) for k in rds.scan_iter(f"aiq:{{@o.{org}}}:{metric}:{scope}:*"))


def all_settled(rds: redis.Redis, org: str) -> None:
    """Wait until every request of the organisation has settled (their ledgers say so)."""
    deadline = time.monotonic() + 20
    while any(
        rds.hget(k, "state") not in ("settled", "reclaimed")
        for k in request_ledgers(rds, f"aiq:{{@o.{org}}}")
    ):
        assert time.monotonic() < deadline, "settlements not applied"
        time.sleep(0.02)


def truth(stack: Stack, ids: set[str]) -> int:
    """Tokens the simulator counted (prompt + generated) for these requests."""
    recs = httpx.get(f"{stack.sim_url}/sim/requests").json()["requests"]
    mine = [r for r in recs if r["client_request_id"] in ids or r["request_id"] in ids]
    assert len(mine) == len(ids), (len(mine), len(ids))
    return sum(r["prompt_tokens_reported"] + r["tokens_sent"] for r in mine)


def until_refused(send: Any, limit: int = 12) -> tuple[set[str], Exception]:
    """Call ``send(request_id)`` until it raises a rate-limit error: (the ids admitted, it)."""
    ids: set[str] = set()
    for _ in range(limit):
        rid = f"eu-{uuid.uuid4().hex[:12]}"
        try:
            send(rid)
        except (openai.RateLimitError, anthropic.RateLimitError) as exc:
            return ids, exc
        ids.add(rid)
    raise AssertionError(f"never refused after {limit} requests")


def oai(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=30)


# -- Anthropic's metadata.user_id --------------------------------------------------------------


def test_anthropic_metadata_user_id_names_the_end_user(body_stack: Stack) -> None:
    """Messages API through the anthropic SDK: m1 is refused near its 300 tokens naming the
    end user (Anthropic's error shape), m2 goes on; m1's counter is what the upstream
    generated for it."""
    rds = redis.Redis(port=body_stack.ports.redis, decode_responses=True)
    claude = anthropic.Anthropic(
        base_url=body_stack.base_url.removesuffix("/v1"), api_key="sk-eu", max_retries=0
    )

    def send(user: str, rid: str) -> None:
        claude.messages.create(
            model="sim-small",
            max_tokens=60,
            messages=[{"role": "user", "content": "Tell me a long story."}],
            metadata={"user_id": user},
            extra_headers={"x-request-id": rid},
        )

    ids, err = until_refused(lambda rid: send("m1", rid))
    assert isinstance(err, anthropic.RateLimitError), err
    assert "end user m1 of team et" in str(err), err
    assert err.response.json()["type"] == "error"  # Anthropic's own error shape
    assert err.response.headers["x-aiquota-limit-level"] == "user=et/m1"
    all_settled(rds, "eo")
    m1 = used(rds, "eo", "u.et.m1")
    assert USER_TPM - 100 < m1 <= USER_TPM
    assert m1 == truth(body_stack, ids)  # billed what the upstream generated for m1
    send("m2", f"eu-{uuid.uuid4().hex[:12]}")  # another end user goes on
    all_settled(rds, "eo")
    assert 0 < used(rds, "eo", "u.et.m2") < USER_TPM
    assert used(rds, "eo", "u.et.m1") == m1
    rds.close()


# -- a configured header ------------------------------------------------------------------------


def test_a_header_names_the_end_user_and_the_body_cannot_rename_it(trusted_stack: Stack) -> None:
    """Sources [jwt, header]: with an API key (no token), ``x-end-user: h1`` names the end user;
    the body's ``user``, a fresh id each time, is no source and is ignored: h1 is refused near
    its 300 tokens, no counter names a body id, and h2 goes on."""
    rds = redis.Redis(port=trusted_stack.ports.redis, decode_responses=True)
    c = oai(trusted_stack, "sk-eu")

    def send(user: str, rid: str) -> None:
        c.chat.completions.create(
            model="sim-small",
            messages=MSG,
            max_tokens=60,
            user=f"body-{uuid.uuid4().hex[:8]}",  # a client choosing a new id per request
            extra_headers={"x-request-id": rid, "x-end-user": user},
        )

    ids, err = until_refused(lambda rid: send("h1", rid))
    assert "end user h1 of team et" in str(err), err
    assert isinstance(err, openai.RateLimitError)
    assert err.response.headers["x-aiquota-limit-level"] == "user=et/h1"
    all_settled(rds, "eo")
    h1 = used(rds, "eo", "u.et.h1")
    assert USER_TPM - 100 < h1 <= USER_TPM
    assert h1 == truth(trusted_stack, ids)
    assert list(rds.scan_iter("aiq:{@o.eo}:*:u.et.body-*")) == []  # no body id counted
    send("h2", f"eu-{uuid.uuid4().hex[:12]}")  # another end user goes on
    all_settled(rds, "eo")
    assert 0 < used(rds, "eo", "u.et.h2") < USER_TPM
    rds.close()


# -- a JWT claim --------------------------------------------------------------------------------


def test_a_jwt_claim_names_the_end_user_and_nothing_else_can(trusted_stack: Stack) -> None:
    """A token verified by Envoy's jwt_authn names tenant e (``org``) and the end user j1
    (``user``); the request also sends ``x-end-user`` and a body ``user`` of its choosing,
    both ignored (the claim comes first): j1 is refused near its 300 tokens; a token naming
    j2 goes on."""
    rds = redis.Redis(port=trusted_stack.ports.redis, decode_responses=True)

    def send(user: str, rid: str) -> None:
        bearer = token({"org": "e", "sub": "app", "user": user})
        oai(trusted_stack, bearer).chat.completions.create(
            model="sim-small",
            messages=MSG,
            max_tokens=60,
            user=f"body-{uuid.uuid4().hex[:8]}",
            extra_headers={"x-request-id": rid, "x-end-user": f"hdr-{uuid.uuid4().hex[:8]}"},
        )

    ids, err = until_refused(lambda rid: send("j1", rid))
    assert "end user j1 of team et" in str(err), err
    assert isinstance(err, openai.RateLimitError)
    assert err.response.headers["x-aiquota-limit-level"] == "user=et/j1"
    all_settled(rds, "eo")
    j1 = used(rds, "eo", "u.et.j1")
    assert USER_TPM - 100 < j1 <= USER_TPM
    assert j1 == truth(trusted_stack, ids)
    assert list(rds.scan_iter("aiq:{@o.eo}:*:u.et.body-*")) == []
    assert list(rds.scan_iter("aiq:{@o.eo}:*:u.et.hdr-*")) == []
    send("j2", f"eu-{uuid.uuid4().hex[:12]}")
    all_settled(rds, "eo")
    assert 0 < used(rds, "eo", "u.et.j2") < USER_TPM
    rds.close()


# -- RLS descriptors naming a level --------------------------------------------------------------


def test_rls_descriptors_naming_a_level_share_the_gateways_counter(body_stack: Stack) -> None:
    """The RLS service running beside the gateway counts ``org=ro`` / ``team=rt`` descriptors
    in the organisation's and team's own counters: after a chat completion of key sk-ro (team
    rt of ro) the RLS answers remaining = limit - what the gateway charged - its own hits; the
    counter holds both; when RLS hits use up the organisation, the gateway's next request is
    refused naming the organisation."""
    rds = redis.Redis(port=body_stack.ports.redis, decode_responses=True)
    c = oai(body_stack, "sk-ro")
    rid = f"rls-{uuid.uuid4().hex[:12]}"
    c.chat.completions.create(
        model="sim-small", messages=MSG, max_tokens=40, extra_headers={"x-request-id": rid}
    )
    all_settled(rds, "ro")
    gw = used(rds, "ro", "o")
    assert gw == truth(body_stack, {rid}) > 0  # what the gateway charged: the upstream's count
    assert used(rds, "ro", "g.rt") == gw
    meta = caller_metadata(body_stack)
    with grpc_channel(body_stack) as ch:
        stub = rls_pb2_grpc.RateLimitServiceStub(ch)
        org = stub.ShouldRateLimit(request("levels", [("org", "ro")], hits=100), metadata=meta)
        team = stub.ShouldRateLimit(request("levels", [("team", "rt")], hits=50), metadata=meta)
        assert org.overall_code == OK and team.overall_code == OK
        assert org.statuses[0].limit_remaining == RLS_ORG_TPM - gw - 100
        assert team.statuses[0].limit_remaining == RLS_TEAM_TPM - gw - 50
        assert used(rds, "ro", "o") == gw + 100  # one counter: the gateway's and the RLS hits
        assert used(rds, "ro", "g.rt") == gw + 50
        # the RLS uses up all but 10 tokens of the organisation ...
        rest = RLS_ORG_TPM - gw - 100 - 10
        fill = stub.ShouldRateLimit(request("levels", [("org", "ro")], hits=rest), metadata=meta)
        assert fill.overall_code == OK and fill.statuses[0].limit_remaining == 10
        over = stub.ShouldRateLimit(request("levels", [("org", "ro")], hits=11), metadata=meta)
        assert over.overall_code == OVER
    counted = used(rds, "ro", "o")
    assert counted >= RLS_ORG_TPM - 10
    # ... so the gateway refuses the next request, naming the organisation
    with pytest.raises(openai.RateLimitError) as info:
        c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=40)
    assert "organisation ro" in str(info.value), info.value
    assert info.value.response.headers["x-aiquota-limit-level"] == "organisation=ro"
    assert used(rds, "ro", "o") == counted  # the refusal charged nothing
    rds.close()
