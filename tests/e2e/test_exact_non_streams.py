"""Non-streaming requests on the exact path, end to end through the real stack: the gateway
sends them upstream as streams with usage, meters every token as it passes and gives the
client the API's JSON rebuilt from the stream.  Checked with the official SDKs against the
simulator's own records (it saw a stream) and against the JSON the simulator answers for the
same request sent to it directly (same seed): the rebuilt body says the same.  An abandoned
non-stream is billed what the simulator had sent when the client left, not a rate."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import redis

from extproc.stack import Stack
from tests.e2e.conftest import make_stack
from tests.helpers import e2e_rules, settled

pytestmark = pytest.mark.e2e

TENANTS = (
    "xchat",
    "xtool",
    "xcompl",
    "xresp",
    "xmsg",
    "xabandon",
    "xjson",
    "xjsonabandon",
    "xlearn",
    "xlearnjson",
    "xlearnboth",
)


@pytest.fixture(scope="module")
def xstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    extra = {
        f"x-{n}": {"plan": "big", "keys": [{"name": n, "plaintext": f"sk-x-{n}"}]} for n in TENANTS
    }
    rules = e2e_rules(extra)
    rules["models"]["sim-small"]["non_streams"] = "exact"
    # the same simulator under a model that keeps today's path (forwarded as JSON)
    for name in ("sim-json", "sim-learn", "sim-learn-json", "sim-learn-both"):
        rules["models"][name] = {
            "tokenizer": {"kind": "tiktoken", "encoding": "cl100k_base"},
            "max_output_tokens": 1024,
            "non_streams": "json",
            "abandoned_tokens_per_second": 200,
        }
    s = make_stack(
        Path(tmp_path_factory.mktemp("exact")),
        rules=rules,
        sim_args=[
            *("--model", "sim-small", "--model", "sim-json"),
            *("--model", "sim-learn", "--model", "sim-learn-json"),
            *("--model", "sim-learn-both"),
        ],
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def xrds(xstack: Stack) -> Iterator[redis.Redis]:
    client = redis.Redis(port=xstack.ports.redis)
    yield client
    client.close()


def oai(stack: Stack, who: str, timeout: float = 30) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=stack.base_url, api_key=f"sk-x-{who}", max_retries=0, timeout=timeout
    )


def records(stack: Stack, tenant: str, want: int = 1) -> list[dict[str, Any]]:
    """The simulator's records of ``tenant``, waiting up to 5 s for ``want`` finished ones."""
    deadline = time.monotonic() + 5
    while True:
        recs = httpx.get(f"{stack.sim_url}/sim/requests").json()["requests"]
        mine = [r for r in recs if r["tenant"] == tenant and r["ending"] != "in_progress"]
        if len(mine) >= want or time.monotonic() > deadline:
            return mine
        time.sleep(0.05)


def direct(stack: Stack, path: str, body: dict[str, Any], seed: int, **headers: str) -> Any:
    """The simulator's own JSON for ``body`` (a non-stream), bypassing the gateway."""
    r = httpx.post(
        f"{stack.sim_url}{path}",
        json=body,
        headers={"x-sim-seed": str(seed), **headers},
        timeout=30,
    )
    r.raise_for_status()
    return r.json()


def truth(rec: dict[str, Any]) -> int:
    """What the simulator computed for one request: its prompt and the tokens it sent."""
    return int(rec["prompt_tokens"]) + int(rec["tokens_sent"])


MSG = [{"role": "user", "content": "Tell me a story about quotas."}]


def test_chat_non_stream_goes_upstream_as_a_stream_and_comes_back_as_json(
    xstack: Stack, xrds: redis.Redis
) -> None:
    got = oai(xstack, "xchat").chat.completions.create(
        model="sim-small",
        messages=MSG,  # type: ignore[arg-type]
        max_tokens=60,
        n=2,
        extra_headers={"x-sim-seed": "11"},
    )
    (rec,) = records(xstack, "x-xchat")
    assert rec["stream"] is True and rec["include_usage"] is True, rec
    want = direct(
        xstack,
        "/v1/chat/completions",
        {"model": "sim-small", "messages": MSG, "max_tokens": 60, "n": 2},
        11,
    )
    assert got.object == "chat.completion"
    assert [c.message.content for c in got.choices] == [
        c["message"]["content"] for c in want["choices"]
    ]
    assert [c.finish_reason for c in got.choices] == [c["finish_reason"] for c in want["choices"]]
    assert got.usage is not None
    assert got.usage.completion_tokens == want["usage"]["completion_tokens"]
    assert got.usage.prompt_tokens == want["usage"]["prompt_tokens"]
    assert settled(xrds, "x-xchat") == truth(rec) == got.usage.total_tokens


def test_chat_tool_call_is_rebuilt(xstack: Stack, xrds: redis.Redis) -> None:
    got = oai(xstack, "xtool").chat.completions.create(
        model="sim-small",
        messages=MSG,  # type: ignore[arg-type]
        max_tokens=80,
        extra_headers={"x-sim-seed": "5", "x-sim-tool-call": "1"},
    )
    want = direct(
        xstack,
        "/v1/chat/completions",
        {"model": "sim-small", "messages": MSG, "max_tokens": 80},
        5,
        **{"x-sim-tool-call": "1"},
    )
    calls = got.choices[0].message.tool_calls
    assert calls, got
    # ids name the simulator's request: only their shape compares
    assert all(c.id.startswith("call_") for c in calls), calls
    assert [
        (c.type, c.function.name, c.function.arguments)  # type: ignore[union-attr]
        for c in calls
    ] == [
        (c["type"], c["function"]["name"], c["function"]["arguments"])
        for c in want["choices"][0]["message"]["tool_calls"]
    ]
    assert got.choices[0].finish_reason == want["choices"][0]["finish_reason"]
    (rec,) = records(xstack, "x-xtool")
    assert settled(xrds, "x-xtool") == truth(rec)


def test_completions_non_stream_is_rebuilt(xstack: Stack, xrds: redis.Redis) -> None:
    got = oai(xstack, "xcompl").completions.create(
        model="sim-small",
        prompt=["Once upon a time", "In a galaxy"],
        max_tokens=40,
        extra_headers={"x-sim-seed": "3"},
    )
    want = direct(
        xstack,
        "/v1/completions",
        {"model": "sim-small", "prompt": ["Once upon a time", "In a galaxy"], "max_tokens": 40},
        3,
    )
    assert got.object == "text_completion"
    assert [(c.index, c.text, c.finish_reason) for c in got.choices] == [
        (c["index"], c["text"], c["finish_reason"]) for c in want["choices"]
    ]
    assert got.usage is not None and got.usage.total_tokens == want["usage"]["total_tokens"]
    (rec,) = records(xstack, "x-xcompl")
    assert rec["stream"] is True
    assert settled(xrds, "x-xcompl") == truth(rec)


def test_responses_non_stream_is_the_completed_events_response(
    xstack: Stack, xrds: redis.Redis
) -> None:
    got = oai(xstack, "xresp").responses.create(
        model="sim-small",
        input="Tell me a story.",
        max_output_tokens=50,
        extra_headers={"x-sim-seed": "9"},
    )
    want = direct(
        xstack,
        "/v1/responses",
        {"model": "sim-small", "input": "Tell me a story.", "max_output_tokens": 50},
        9,
    )
    assert got.object == "response" and got.status == want["status"]
    texts = [
        p["text"]
        for item in want["output"]
        for p in item.get("content") or []
        if p.get("type") == "output_text"
    ]
    assert got.output_text == "".join(texts)
    assert got.usage is not None
    assert got.usage.output_tokens == want["usage"]["output_tokens"]
    (rec,) = records(xstack, "x-xresp")
    assert rec["stream"] is True
    assert settled(xrds, "x-xresp") == truth(rec) == got.usage.total_tokens


def test_messages_non_stream_is_rebuilt(xstack: Stack, xrds: redis.Redis) -> None:
    c = anthropic.Anthropic(
        base_url=xstack.base_url.removesuffix("/v1"), api_key="sk-x-xmsg", max_retries=0
    )
    got = c.messages.create(
        model="sim-small",
        max_tokens=50,
        messages=[{"role": "user", "content": "Tell me a story."}],
        extra_headers={"x-sim-seed": "4"},
    )
    want = direct(
        xstack,
        "/v1/messages",
        {
            "model": "sim-small",
            "max_tokens": 50,
            "messages": [{"role": "user", "content": "Tell me a story."}],
        },
        4,
    )
    assert got.type == "message" and got.role == "assistant"
    assert [b.model_dump(exclude_none=True) for b in got.content] == [
        {k: v for k, v in b.items() if v is not None} for b in want["content"]
    ]
    assert got.stop_reason == want["stop_reason"]
    assert got.usage.input_tokens == want["usage"]["input_tokens"]
    assert got.usage.output_tokens == want["usage"]["output_tokens"]
    (rec,) = records(xstack, "x-xmsg")
    assert rec["stream"] is True
    assert settled(xrds, "x-xmsg") == truth(rec)


def abandon(stack: Stack, rds: redis.Redis, who: str, model: str) -> tuple[int, dict[str, Any]]:
    """A chat non-stream of 1,000 tokens at 10 ms each, whose client leaves after 1 s."""
    with pytest.raises(openai.APITimeoutError):
        oai(stack, who, timeout=1.0).chat.completions.create(
            model=model,
            messages=MSG,  # type: ignore[arg-type]
            max_tokens=1000,
            extra_headers={"x-sim-tokens": "1000", "x-sim-itl-ms": "10", "x-sim-ttft-ms": "50"},
        )
    (rec,) = records(stack, f"x-{who}")
    return settled(rds, f"x-{who}"), rec


def test_an_abandoned_non_stream_bills_what_passed(xstack: Stack, xrds: redis.Redis) -> None:
    """The client leaves after 1 s: the simulator saw the disconnect having sent some hundred
    tokens; the bill is its prompt and those tokens (within 2 % + 16), not a rate (200
    tokens/s would bill about twice as many here)."""
    billed, rec = abandon(xstack, xrds, "xabandon", "sim-small")
    assert rec["ending"] != "completed" and rec["disconnected_at"] is not None, rec
    sent = int(rec["tokens_sent"])
    assert 20 < sent < 1000, rec
    out = billed - int(rec["prompt_tokens"])
    # the gateway's recount of the simulator's words and its own prompt count may each differ
    # from the simulator's by a token: the bound, both ways
    assert abs(out - sent) <= 0.02 * sent + 16, (billed, rec)


def test_the_json_path_still_bills_by_the_rate(xstack: Stack, xrds: redis.Redis) -> None:
    """A model on ``non_streams: json``: forwarded as JSON (the simulator saw no stream), and
    an abandon is billed by the model's rate for the time it ran."""
    got = oai(xstack, "xjson").chat.completions.create(
        model="sim-json",
        messages=MSG,  # type: ignore[arg-type]
        max_tokens=30,
    )
    (rec,) = records(xstack, "x-xjson")
    assert rec["stream"] is False
    assert got.usage is not None
    assert settled(xrds, "x-xjson") == truth(rec) == got.usage.total_tokens
    billed, rec = abandon(xstack, xrds, "xjsonabandon", "sim-json")
    out = billed - int(rec["prompt_tokens"])
    assert 200 <= out <= 200 * 1.5, (billed, rec)


def test_the_json_path_bills_an_abandon_at_the_learned_rate(
    xstack: Stack, xrds: redis.Redis
) -> None:
    """Where the gateway cannot meter a non-stream (here a model on ``non_streams: json``), an
    abandon is billed at the model's decode rate learned from its completed streams (output
    per sequence over first chunk to end, from their time to start), not the configured 200
    tokens/s: after five streams at 10 ms a token (~100 tokens/s here), an abandon after 1 s
    is billed about what the simulator had made."""

    def one(_: int) -> None:
        for _chunk in oai(xstack, "xlearn").chat.completions.create(
            model="sim-learn",
            messages=MSG,  # type: ignore[arg-type]
            max_tokens=100,
            stream=True,
            extra_headers={"x-sim-tokens": "100", "x-sim-itl-ms": "10", "x-sim-ttft-ms": "50"},
        ):
            pass

    with ThreadPoolExecutor(5) as pool:
        list(pool.map(one, range(5)))
    settled(xrds, "x-xlearn", expect=5)
    billed_before = settled(xrds, "x-xlearn", expect=5)
    with pytest.raises(openai.APITimeoutError):
        oai(xstack, "xlearn", timeout=1.0).chat.completions.create(
            model="sim-learn",
            messages=MSG,  # type: ignore[arg-type]
            max_tokens=1000,
            extra_headers={"x-sim-tokens": "1000", "x-sim-itl-ms": "10", "x-sim-ttft-ms": "50"},
        )
    recs = records(xstack, "x-xlearn", want=6)
    (rec,) = [r for r in recs if r["ending"] != "completed"]
    billed = settled(xrds, "x-xlearn", expect=6) - billed_before
    out = billed - int(rec["prompt_tokens"])
    # a JSON answer is sent whole at its end: what the simulator had made when the client
    # left is its time then (after the first token's 50 ms) at 10 ms a token
    ran = float(rec["disconnected_at"] or rec["ended_at"]) - float(rec["started_at"])
    made = max(0.0, (ran - 0.05) / 0.010)
    assert out < 0.75 * 200, (out, made, rec)  # not the configured rate
    assert abs(out - made) <= 0.25 * made + 16, (out, made, rec)


def test_json_traffic_alone_teaches_the_rate(xstack: Stack, xrds: redis.Redis) -> None:
    """A model whose traffic is all non-streams on the JSON path learns its decode rate from
    them (output per sequence over admission to end): after five at 10 ms a token, an abandon
    after 1 s is billed about what the simulator had made, not the configured 200 tokens/s."""
    headers = {"x-sim-tokens": "100", "x-sim-itl-ms": "10", "x-sim-ttft-ms": "50"}

    def one(_: int) -> None:
        oai(xstack, "xlearnjson").chat.completions.create(
            model="sim-learn-json",
            messages=MSG,  # type: ignore[arg-type]
            max_tokens=100,
            extra_headers=headers,
        )

    with ThreadPoolExecutor(5) as pool:
        list(pool.map(one, range(5)))
    billed_before = settled(xrds, "x-xlearnjson", expect=5)
    with pytest.raises(openai.APITimeoutError):
        oai(xstack, "xlearnjson", timeout=1.0).chat.completions.create(
            model="sim-learn-json",
            messages=MSG,  # type: ignore[arg-type]
            max_tokens=1000,
            extra_headers={**headers, "x-sim-tokens": "1000"},
        )
    recs = records(xstack, "x-xlearnjson", want=6)
    (rec,) = [r for r in recs if r["ending"] != "completed"]
    out = settled(xrds, "x-xlearnjson", expect=6) - billed_before - int(rec["prompt_tokens"])
    ran = float(rec["disconnected_at"] or rec["ended_at"]) - float(rec["started_at"])
    made = max(0.0, (ran - 0.05) / 0.010)
    assert out < 0.75 * 200, (out, made, rec)  # not the configured rate
    assert abs(out - made) <= 0.25 * made + 16, (out, made, rec)


def test_a_json_abandon_is_billed_at_the_models_json_speed_not_its_streams(
    xstack: Stack, xrds: redis.Redis
) -> None:
    """An engine decodes its streams slower than its non-streams (the CPU vLLM: 10-17 %): a
    model whose streams ran at 20 ms a token and whose non-streams at 10 ms bills an abandoned
    non-stream at its non-streams' speed (~100 tokens/s), not its streams' (~50), nor the
    median of both kinds (its last nine responses: five streams, four non-streams); the start
    is still its streams' (the shortest first chunk)."""
    fast = {"x-sim-tokens": "100", "x-sim-itl-ms": "10", "x-sim-ttft-ms": "50"}
    slow = {"x-sim-tokens": "60", "x-sim-itl-ms": "20", "x-sim-ttft-ms": "50"}
    c = oai(xstack, "xlearnboth")

    def stream(_: int) -> None:
        for _chunk in c.chat.completions.create(
            model="sim-learn-both",
            messages=MSG,  # type: ignore[arg-type]
            max_tokens=100,
            stream=True,
            extra_headers=slow,
        ):
            pass

    def non_stream(_: int) -> None:
        c.chat.completions.create(
            model="sim-learn-both",
            messages=MSG,  # type: ignore[arg-type]
            max_tokens=100,
            extra_headers=fast,
        )

    with ThreadPoolExecutor(5) as pool:
        list(pool.map(stream, range(5)))  # first: the start the JSON rates are taken after
        list(pool.map(non_stream, range(5)))
        settled(xrds, "x-xlearnboth", expect=10)
        list(pool.map(stream, range(5)))  # last: the streams' rate is the mixed median's
    billed_before = settled(xrds, "x-xlearnboth", expect=15)
    with pytest.raises(openai.APITimeoutError):
        oai(xstack, "xlearnboth", timeout=1.0).chat.completions.create(
            model="sim-learn-both",
            messages=MSG,  # type: ignore[arg-type]
            max_tokens=1000,
            extra_headers={**fast, "x-sim-tokens": "1000"},
        )
    recs = records(xstack, "x-xlearnboth", want=16)
    (rec,) = [r for r in recs if r["ending"] != "completed"]
    out = settled(xrds, "x-xlearnboth", expect=16) - billed_before - int(rec["prompt_tokens"])
    ran = float(rec["disconnected_at"] or rec["ended_at"]) - float(rec["started_at"])
    made = max(0.0, (ran - 0.05) / 0.010)
    assert out > 0.8 * made, (out, made, rec)  # not the streams' half speed
    assert abs(out - made) <= 0.25 * made + 16, (out, made, rec)
