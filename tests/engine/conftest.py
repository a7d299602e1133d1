"""Engine fixtures: a real vLLM (CPU build, tiny local model) pinned to one core, and the real
gateway stack (Envoy + ``ai-quota serve`` + Redis) pinned to the others, routing to it.

vLLM lives in ``.venv-engine`` (``scripts/setup --engine``). Without it the engine tests are
skipped, unless ``AIQ_ENGINE_REQUIRED=1`` (``scripts/test --engine`` sets it), where they fail.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from extproc.bench.vllm import (
    SERVED_NAME,
    Engine,
    engine_python,
    pin_self,
    split_cpus,
)
from extproc.stack import Stack
from tests.e2e.conftest import make_stack

DAY = "day"
EVERY = 16  # charge_every_tokens


def engine_rules(tokenizer_json: Path) -> dict[str, Any]:
    """One model (the engine's, with its own tokenizer.json), one tenant per scenario."""

    def plan(tpm: int, streaming: str = "lazy") -> dict[str, Any]:
        return {
            "limits": [{"model": "*", "per": DAY, "rpm": 100_000, "tpm": tpm}],
            "charging": {"streaming": streaming},
        }

    plans = {
        "big": plan(10_000_000),
        "lazy300": plan(300),
        "strict300": plan(300, "strict"),
        "lazy1500": plan(1500),
        "strict1500": plan(1500, "strict"),
    }
    tenants = {
        "chat": "big",
        "chatstream": "big",
        "completions": "big",
        "completionsstream": "big",
        "responses": "big",
        "responsesstream": "big",
        "messages": "big",
        "messagesstream": "big",
        "cjk": "big",
        "bytes": "big",
        "cutlazy": "lazy300",
        "cutstrict": "strict300",
        "conclazy": "lazy1500",
        "concstrict": "strict1500",
    }
    return {
        "version": 1,
        "charging": {
            "mode": "stream_incremental",
            "streaming": "lazy",
            "charge_every_tokens": EVERY,
        },
        "models": {
            SERVED_NAME: {
                "tokenizer": {"kind": "huggingface", "path": str(tokenizer_json)},
                "max_output_tokens": 2048,
            }
        },
        "plans": plans,
        "tenants": {
            f"e-{name}": {"plan": p, "keys": [{"name": name, "plaintext": f"sk-{name}"}]}
            for name, p in tenants.items()
        },
    }


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """vLLM serving the tiny model, pinned to the first CPU (the caller moves to the others)."""
    py = engine_python()
    if py is None:
        msg = "vLLM is not installed: run scripts/setup --engine"
        if os.environ.get("AIQ_ENGINE_REQUIRED") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    engine_cpus, gateway_cpus = split_cpus()
    before = pin_self(gateway_cpus)
    e = Engine(workdir=Path(tmp_path_factory.mktemp("vllm")), cpuset=engine_cpus, python=py)
    try:
        e.start()
        yield e
    finally:
        e.stop()
        pin_self(before)


@pytest.fixture(scope="session")
def gateway(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Envoy + processor + Redis (on the gateway's CPUs, inherited from this process) in front
    of the engine, metering the model with the engine's own tokenizer.json."""
    assert engine.model is not None
    s = make_stack(
        Path(tmp_path_factory.mktemp("gateway")),
        rules=engine_rules(engine.model / "tokenizer.json"),
        upstream=("127.0.0.1", engine.port),
    )
    yield s
    s.stop()


@pytest.fixture(scope="session")
def grds(gateway: Stack) -> redis.Redis:
    """A client of the gateway's Redis."""
    return redis.Redis(port=gateway.ports.redis, decode_responses=True)
