"""Charging modes, per-model and per-key buckets, and the usage API, through the real stack."""

from __future__ import annotations

import subprocess
import sys

import openai
import orjson
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam

from extproc.stack import Stack
from tests.e2e.conftest import client, usage_flags
from tests.e2e.test_streaming import ENGINE_PROMPT, PROMPT
from tests.helpers import settled, tpm_used

pytestmark = pytest.mark.e2e

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a long story."}]


def test_input_only_charges_just_the_prompt(stack: Stack, rds: redis.Redis) -> None:
    """input_only: a stream and a non-stream cost their prompt tokens only, and are never cut."""
    c = client(stack, "sk-inputonly")
    c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=50)
    chunks = list(
        c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=60, stream=True)
    )
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) == 60
    assert tpm_used(rds, "t-inputonly") == 2 * PROMPT  # final at admission


def test_reserve_max_keeps_the_whole_reservation(stack: Stack, rds: redis.Redis) -> None:
    """reserve_max: input + max_tokens is charged and never refunded."""
    c = client(stack, "sk-reservemax")
    c.chat.completions.create(
        model="sim-small", messages=MSG, max_tokens=300, extra_headers={"x-sim-tokens": "5"}
    )
    assert tpm_used(rds, "t-reservemax") == PROMPT + 300  # final at admission


def test_reserve_refund_settles_streams_to_actual(stack: Stack, rds: redis.Redis) -> None:
    """reserve_refund: a stream reserves max_tokens and settles to what was generated."""
    c = client(stack, "sk-reserverefund")
    chunks = list(
        c.chat.completions.create(
            model="sim-small",
            messages=MSG,
            max_tokens=400,
            stream=True,
            extra_headers={"x-sim-tokens": "30"},
        )
    )
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) == 30
    assert settled(rds, "t-reserverefund") == ENGINE_PROMPT + 30  # the upstream's figures


def test_model_and_key_buckets_apply_together(stack: Stack, rds: redis.Redis) -> None:
    """A per-model TPM bucket and a per-key RPM bucket both bind, each with its own code."""
    c = client(stack, "sk-modeltpm")
    c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=400)
    with pytest.raises(openai.RateLimitError) as info:
        c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=100)
    assert info.value.code == "tpm_limit_exceeded"
    assert "model sim-small" in info.value.message
    # the refused request did not count toward RPM (count_refused_requests: false)
    c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=20)
    c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=20)
    with pytest.raises(openai.RateLimitError) as info:
        c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=1)
    assert info.value.code == "rpm_limit_exceeded"
    assert info.value.response.headers["x-ratelimit-limit-requests"] == "3"


def test_usage_cli_shows_where_a_tenant_stands(stack: Stack, rds: redis.Redis) -> None:
    """`ai-quota usage --key` reads the live counters through the gateway's own gRPC API, over
    the port's TLS; `--tenant` needs the admin token (docs/security.md)."""
    client(stack, "sk-usage").chat.completions.create(
        model="sim-small", messages=MSG, max_tokens=40
    )
    used = settled(rds, "t-usage")

    def usage(*args: str, admin: bool = False) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "extproc", "usage", *args, *usage_flags(stack, admin=admin)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    out = usage("--key", "sk-usage", "--json")
    assert out.returncode == 0, out.stderr
    doc = orjson.loads(out.stdout)
    assert doc["tenant"] == "t-usage" and doc["plan"] == "tpm5000"
    tpm = next(b for b in doc["buckets"] if b["metric"] == "tpm")
    assert tpm["used"] == used and tpm["limit"] == 5000 and tpm["remaining"] == 5000 - used
    table = usage("--tenant", "t-usage", admin=True)
    assert table.returncode == 0, table.stderr
    assert "t-usage" in table.stdout and str(used) in table.stdout
    anyone = usage("--tenant", "t-usage")  # a tenant id is no credential
    assert anyone.returncode == 1 and "UNAUTHENTICATED" in anyone.stderr
    bad = usage("--key", "sk-nobody")
    assert bad.returncode == 1 and "UNAUTHENTICATED" in bad.stderr
    unknown = usage("--key", "sk-nobody", admin=True)  # the admin learns that it is unknown
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
