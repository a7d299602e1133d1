"""Admission through the real stack, driven by the official openai SDK."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import orjson
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam

from extproc.core.apis.openai.counting import count_chat_request
from extproc.core.tokens import TokenizerSpec
from extproc.sim.prompt_tokens import chat_prompt_tokens
from extproc.stack import Stack
from extproc.tokenizers import load_counter
from tests.e2e.conftest import client
from tests.helpers import settled, tpm_used

pytestmark = pytest.mark.e2e

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something."}]
_SPEC = TokenizerSpec(kind="tiktoken", encoding="cl100k_base")
#: The gateway's count of MSG (charged at admission) and the simulator's (charged at settlement).
PROMPT = count_chat_request({"messages": MSG}, load_counter(_SPEC), _SPEC)
ENGINE_PROMPT = chat_prompt_tokens(MSG)
RL_HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)


def sim_records(stack: Stack, tenant: str) -> list[dict[str, Any]]:
    recs = httpx.get(f"{stack.sim_url}/sim/requests").json()["requests"]
    return [r for r in recs if r["tenant"] == tenant]


def test_non_streaming_completion_carries_rate_limit_headers(stack: Stack) -> None:
    """An admitted non-streaming request returns the upstream's answer plus x-ratelimit-* headers."""
    raw = client(stack, "sk-std").chat.completions.with_raw_response.create(
        model="sim-small", messages=MSG, max_tokens=12
    )
    comp = raw.parse()
    assert comp.usage is not None and comp.usage.completion_tokens == 12
    for h in RL_HEADERS:
        assert h in raw.headers, h
    assert raw.headers["x-ratelimit-limit-requests"] == "100000"
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 10_000_000


def test_alias_is_rewritten_to_the_canonical_model(stack: Stack) -> None:
    """A request for an alias reaches the upstream under the model's real name."""
    comp = client(stack, "sk-alias").chat.completions.create(
        model="sim", messages=MSG, max_tokens=3
    )
    assert comp.model == "sim-small"


def test_identity_headers_are_set_by_the_gateway_not_the_client(stack: Stack) -> None:
    """A client-supplied x-quota-tenant is replaced by the tenant the key belongs to."""
    client(stack, "sk-std").chat.completions.create(
        model="sim-small",
        messages=MSG,
        max_tokens=2,
        extra_headers={"x-quota-tenant": "t-big-spender"},
    )
    rec = sim_records(stack, "t-std")[-1]
    assert rec["headers_seen"]["x-quota-tenant"] == "t-std"
    assert rec["headers_seen"]["x-quota-plan"] == "big"


def test_streaming_passes_through_without_the_forced_usage_chunk(stack: Stack) -> None:
    """A stream reaches the client whole; the usage chunk the gateway forced is stripped."""
    c = client(stack, "sk-std")
    chunks = list(
        c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=40, stream=True)
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text
    assert all(ch.usage is None for ch in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    rec = sim_records(stack, "t-std")[-1]
    assert rec["include_usage"] is True and rec["tokens_sent"] == 40


def test_streaming_keeps_usage_when_the_client_asks(stack: Stack) -> None:
    """With stream_options.include_usage the client gets the usage chunk."""
    c = client(stack, "sk-std")
    chunks = list(
        c.chat.completions.create(
            model="sim-small",
            messages=MSG,
            max_tokens=25,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = [ch.usage for ch in chunks if ch.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 25


@pytest.mark.parametrize("key", [None, "sk-nope"])
def test_missing_or_unknown_key_is_401(stack: Stack, key: str | None) -> None:
    """No key or an unknown key gets a 401 with an OpenAI-style error body."""
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    r = httpx.post(
        f"{stack.base_url}/chat/completions",
        headers=headers,
        content=orjson.dumps({"model": "sim-small", "messages": MSG}),
    )
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        client(stack, "sk-nope").chat.completions.create(model="sim-small", messages=MSG)


def test_api_key_header_is_accepted(stack: Stack) -> None:
    """Azure-style 'api-key' header identifies the tenant too."""
    r = httpx.post(
        f"{stack.base_url}/chat/completions",
        headers={"api-key": "sk-std", "content-type": "application/json"},
        content=orjson.dumps({"model": "sim-small", "messages": MSG, "max_tokens": 2}),
    )
    assert r.status_code == 200


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1,2]", "JSON object"),
        (orjson.dumps({"model": "sim-small", "messages": MSG, "max_tokens": -5}), "max_tokens"),
        (orjson.dumps({"model": "sim-small", "messages": MSG, "max_tokens": 1.5}), "max_tokens"),
        (orjson.dumps({"model": "sim-small", "messages": MSG, "max_tokens": 10**12}), "at most"),
        (orjson.dumps({"model": "sim-small", "messages": "hi"}), "messages"),
        (orjson.dumps({"model": "sim-small", "messages": MSG, "stream": "yes"}), "stream"),
        (
            orjson.dumps({"model": "sim-small", "messages": [{"role": "user", "content": 5}]}),
            "content",
        ),
    ],
)
def test_malformed_requests_are_400_and_cost_nothing(
    stack: Stack, rds: redis.Redis, body: bytes, fragment: str
) -> None:
    """Bad input gets a 400 naming the problem, and no quota is charged."""
    before = tpm_used(rds, "t-bad")
    r = httpx.post(
        f"{stack.base_url}/chat/completions",
        headers={"authorization": "Bearer sk-bad", "content-type": "application/json"},
        content=body,
    )
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    assert tpm_used(rds, "t-bad") == before


def test_negative_max_tokens_raises_bad_request_in_the_sdk(stack: Stack) -> None:
    """The SDK surfaces the gateway's 400 as BadRequestError."""
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client(stack, "sk-bad").chat.completions.create(
            model="sim-small", messages=MSG, max_tokens=-1
        )


def test_unknown_model_is_404(stack: Stack) -> None:
    """A model the gateway does not know is refused before the upstream."""
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(stack, "sk-bad").chat.completions.create(model="gpt-nope", messages=MSG)


def test_oversized_body_is_413(stack: Stack) -> None:
    """A body over the listener buffer limit is refused by Envoy with 413 and never charged."""
    big = orjson.dumps(
        {"model": "sim-small", "messages": [{"role": "user", "content": "x " * 700_000}]}
    )
    r = httpx.post(
        f"{stack.base_url}/chat/completions",
        headers={"authorization": "Bearer sk-bad", "content-type": "application/json"},
        content=big,
    )
    assert r.status_code == 413


def test_rpm_limit_refuses_with_openai_headers(stack: Stack) -> None:
    """The third request of a 2-RPM tenant is a 429 the SDK raises as RateLimitError."""
    c = client(stack, "sk-rpm")
    for _ in range(2):
        c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=2)
    with pytest.raises(openai.RateLimitError) as info:
        c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=2)
    resp = info.value.response
    assert info.value.code == "rpm_limit_exceeded"
    assert info.value.type == "requests"
    assert int(resp.headers["retry-after"]) >= 1
    assert resp.headers["x-ratelimit-limit-requests"] == "2"
    assert resp.headers["x-ratelimit-remaining-requests"] == "0"
    for h in RL_HEADERS:
        assert h in resp.headers


def test_tpm_limit_counts_real_tokens(stack: Stack, rds: redis.Redis) -> None:
    """TPM admission charges the counted input plus the reserved output, exactly; settlement
    holds the upstream's own figures."""
    c = client(stack, "sk-tpm")
    # non-streaming: input + max_tokens reserved, settled to the upstream's usage
    c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=100)
    used = settled(rds, "t-tpm")
    assert used == ENGINE_PROMPT + 100
    room = 300 - used
    # admission reserves the gateway's own count and max_tokens: one token more does not fit
    with pytest.raises(openai.RateLimitError) as info:
        c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=room - PROMPT + 1)
    assert info.value.code == "tpm_limit_exceeded" and info.value.type == "tokens"
    assert info.value.response.headers["x-ratelimit-remaining-tokens"] == str(room)
    ok = c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=room - PROMPT)
    assert ok.usage is not None
    assert settled(rds, "t-tpm", expect=2) == used + ENGINE_PROMPT + room - PROMPT


def test_request_larger_than_the_limit_says_so(stack: Stack) -> None:
    """A request that could never fit is told which limit and by how much."""
    with pytest.raises(openai.RateLimitError, match="Request too large"):
        client(stack, "sk-toolong").chat.completions.create(
            model="sim-small", messages=MSG, max_tokens=1000
        )


def test_non_streaming_reservation_is_refunded_to_actual_usage(
    stack: Stack, rds: redis.Redis
) -> None:
    """max_tokens is reserved at admission; settlement keeps only what the upstream generated."""
    c = client(stack, "sk-refund")
    comp = c.chat.completions.create(
        model="sim-small", messages=MSG, max_tokens=900, extra_headers={"x-sim-tokens": "10"}
    )
    assert comp.usage is not None and comp.usage.completion_tokens == 10
    used = settled(rds, "t-refund")
    assert used - 10 < 40  # only the prompt and 10 output tokens remain charged


def test_upstream_error_refunds_tokens_but_counts_the_request(
    stack: Stack, rds: redis.Redis
) -> None:
    """An upstream 500 costs no tokens; the request still counts toward RPM (judged against
    the tenant's counters before it: another module's test uses the same tenant)."""
    c = client(stack, "sk-uperr")
    tokens = settled(rds, "t-uperr", expect=0)
    requests = tpm_used(rds, "t-uperr", "rpm")
    with pytest.raises(openai.InternalServerError):
        c.chat.completions.create(
            model="sim-small", messages=MSG, max_tokens=200, extra_headers={"x-sim-status": "500"}
        )
    assert settled(rds, "t-uperr") == tokens
    assert tpm_used(rds, "t-uperr", "rpm") == requests + 1


def test_health_and_model_listing_need_no_key(stack: Stack) -> None:
    """A load balancer's GET /health and a client's GET /v1/models pass without an API key
    (paths.public); a metered call without one is still a 401."""
    base = stack.base_url.removesuffix("/v1")
    health = httpx.get(f"{base}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    models = httpx.get(f"{base}/v1/models", timeout=10)
    assert models.status_code == 200, models.text
    assert any(m["id"] == "sim-small" for m in models.json()["data"])
    chat = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert chat.status_code == 401 and chat.json()["error"]["code"] == "invalid_api_key"


def test_other_paths_pass_through_with_a_valid_key(stack: Stack) -> None:
    """/v1/models is not metered; a key that is presented must be valid."""
    models = client(stack, "sk-passthru").models.list()
    assert any(m.id == "sim-small" for m in models.data)
    with pytest.raises(openai.AuthenticationError):
        client(stack, "sk-wrong").models.list()


def test_two_envoys_share_one_quota(pair: Stack) -> None:
    """Two Envoys and two processors on one Redis admit exactly the limit, not twice it."""
    admitted = refused = 0
    for i in range(8):
        try:
            client(pair, "sk-twoenvoy", envoy=i % 2).chat.completions.create(
                model="sim-small", messages=MSG, max_tokens=2
            )
            admitted += 1
        except openai.RateLimitError:
            refused += 1
    assert (admitted, refused) == (4, 4)


def test_completions_endpoint_is_metered(stack: Stack, rds: redis.Redis) -> None:
    """/v1/completions: the prompt is counted, streamed and non-streamed answers settle."""
    c = client(stack, "sk-completions")
    comp = c.completions.create(model="sim-small", prompt="Once upon a time", max_tokens=7)
    assert comp.usage is not None and comp.usage.completion_tokens == 7
    text = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model="sim-small", prompt=["Once upon a time"], max_tokens=9, stream=True
        )
        if ch.choices
    )
    assert text
    used = settled(rds, "t-completions", expect=2)
    prompt = 4  # "Once upon a time" in cl100k_base
    assert used == 2 * prompt + 7 + 9


def test_a_reused_request_id_is_charged_again(stack: Stack, rds: redis.Redis) -> None:
    """A client sending the same x-request-id twice makes two requests, and pays for both."""
    c = client(stack, "sk-replay")
    for _ in range(2):
        c.chat.completions.create(
            model="sim-small",
            messages=MSG,
            max_tokens=5,
            extra_headers={"x-request-id": "fixed-id-1"},
        )
    assert tpm_used(rds, "t-replay", "rpm") == 2


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions/",
        "//v1//chat/completions",
        "/v1/./chat/completions",
        "/V1/Chat/Completions",
    ],
)
def test_path_tricks_do_not_escape_metering(stack: Stack, path: str) -> None:
    """Variants of the metered path reach admission too (here: its JSON check refuses them)."""
    r = httpx.post(
        f"http://127.0.0.1:{stack.ports.envoy}{path}",
        headers={"authorization": "Bearer sk-std", "content-type": "application/json"},
        content=b"{not json",
    )
    assert r.status_code == 400, r.text
    assert "not valid JSON" in r.json()["error"]["message"]
