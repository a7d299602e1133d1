"""Local allowances on the real stack: Envoy, two ``ai-quota serve`` processors with
``AIQ_ALLOWANCES=1``, the simulator and Redis, driven by the openai SDK.  Far from its limits
a tenant's non-streaming requests cost at most 0.1 Redis round trips each and its streams at
most one (INFO commandstats), and once the processors have drained (SIGTERM: they give their allowances back)
the counters hold exactly what the requests used."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam

from extproc.bench import system
from extproc.stack import Stack
from tests.e2e.conftest import client, make_stack, usage_flags
from tests.helpers import e2e_rules, tpm_used

pytestmark = pytest.mark.e2e

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]
TENANT = "t-allow"


@pytest.fixture(scope="module")
def astack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    rules = e2e_rules(
        {TENANT: {"plan": "big", "keys": [{"name": "allow", "plaintext": "sk-allow"}]}}
    )
    s = make_stack(
        Path(tmp_path_factory.mktemp("allow")),
        extprocs=2,
        rules=rules,
        # the e2e windows are days: allowances apply to windows up to this long; no usage
        # records (their appends are scripts too: commandstats would count them)
        extproc_env={
            "AIQ_ALLOWANCES": "1",
            "AIQ_ALLOWANCE_MAX_WINDOW_S": "86400",
            "AIQ_USAGE_STREAM": "off",
        },
    )
    yield s
    s.stop()


def run(stack: Stack, count: int) -> list[int]:
    """``count`` non-streaming requests, four at a time: each one's total tokens."""
    sdk = client(stack, "sk-allow")

    def one(_: int) -> int:
        r = sdk.chat.completions.create(model="sim-small", messages=MSG, max_tokens=8)
        assert r.usage is not None
        return r.usage.total_tokens

    try:
        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(one, range(count)))
    finally:
        sdk.close()


def streams(stack: Stack, count: int) -> list[int]:
    """``count`` streams of up to 256 tokens, four at a time: each one's total tokens."""
    sdk = client(stack, "sk-allow")

    def one(_: int) -> int:
        total = 0
        for ch in sdk.chat.completions.create(
            model="sim-small",
            messages=MSG,
            max_tokens=256,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if ch.usage is not None:
                total = ch.usage.total_tokens
        assert total > 0
        return total

    try:
        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(one, range(count)))
    finally:
        sdk.close()


STREAMED: list[int] = []


def test_streams_far_from_the_limit_take_at_most_one_round_trip(astack: Stack) -> None:
    """Lazy streams charged every 16 tokens (16 charges for 256 tokens) draw from the
    allowances: at most one Redis round trip per stream."""
    STREAMED.extend(streams(astack, 40))  # warm-up
    before = system.redis_calls(astack.ports.redis)
    STREAMED.extend(streams(astack, 60))
    after = system.redis_calls(astack.ports.redis)
    calls = system.limiter_round_trips(before, after)
    print(f"limiter round trips per stream: {sum(calls.values()) / 60:.3f} {calls}")
    assert sum(calls.values()) / 60 <= 1.0, calls


def test_far_from_the_limit_requests_skip_redis_and_counters_end_exact(astack: Stack) -> None:
    warm = run(astack, 60)  # each processor sees the bucket busy and takes allowances
    before = system.redis_calls(astack.ports.redis)
    used = run(astack, 300)
    after = system.redis_calls(astack.ports.redis)
    calls = system.limiter_round_trips(before, after)
    print(f"limiter round trips per request: {sum(calls.values()) / 300:.3f} {calls}")
    assert sum(calls.values()) / 300 <= 0.1, calls
    rds = redis.Redis(port=astack.ports.redis)
    truth = {"tpm": sum(warm) + sum(used) + sum(STREAMED), "rpm": 360 + len(STREAMED)}
    # Before the drain the counters hold the replicas' allowances on top of the requests'
    # use; what `ai-quota usage` shows through either processor (net of its own allowances)
    # is never below the use and never above the counters (no request runs meanwhile: they
    # can only shrink, by give-backs).
    gross = {m: tpm_used(rds, TENANT, m) for m in truth}
    for port in astack.extproc_ports:
        shown = {b["metric"]: b["used"] for b in usage(astack, port)["buckets"]}
        for m, n in truth.items():
            assert n <= shown[m] <= gross[m], (port, m, n, shown[m], gross[m])
    astack.kill("extproc0")  # SIGTERM: drain, give the allowances back
    astack.kill("extproc1")
    try:
        assert tpm_used(rds, TENANT) == sum(warm) + sum(used) + sum(STREAMED)
        assert tpm_used(rds, TENANT, "rpm") == 360 + len(STREAMED)
    finally:
        rds.close()


def usage(stack: Stack, port: int) -> dict[str, Any]:
    """``ai-quota usage --key sk-allow --json`` answered by the processor on ``port``."""
    flags = usage_flags(stack)
    flags[flags.index("--address") + 1] = f"127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "extproc", "usage", "--key", "sk-allow", "--json", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True)
    return dict(orjson.loads(out.stdout))
