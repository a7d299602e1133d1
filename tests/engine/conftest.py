"""Engine fixtures: a real vLLM (CPU build, tiny local model) pinned to one core, and the real
gateway stack (Envoy + ``ai-quota serve`` + Redis) pinned to the others, routing to it.

vLLM lives in ``.venv-engine`` (``scripts/setup --engine``). Without it the engine tests are
skipped, unless ``AIQ_ENGINE_REQUIRED=1`` (``scripts/test --engine`` sets it), where they fail.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from extproc.bench.vllm import Engine, engine_python, pin_self, split_cpus, start_gateway
from extproc.stack import Stack


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
    s = start_gateway(Path(tmp_path_factory.mktemp("gateway")), engine)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def grds(gateway: Stack) -> Iterator[redis.Redis]:
    """A client of the gateway's Redis."""
    client = redis.Redis(port=gateway.ports.redis, decode_responses=True)
    yield client
    client.close()
