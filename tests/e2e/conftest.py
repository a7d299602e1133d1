"""End-to-end fixtures: the real stack (redis-server, simulator, ext_proc, Envoy) on free ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from extproc.stack import Stack, StackPorts, free_port
from tests.helpers import e2e_rules, write_rules

SIM_ARGS = ["--ttft-ms", "5", "--itl-ms", "2"]


def make_stack(
    workdir: Path,
    *,
    envoys: int = 1,
    extprocs: int = 1,
    rules: dict[str, Any] | None = None,
    redis_url: str | None = None,
    sim_args: list[str] | None = None,
    **stack_kw: Any,
) -> Stack:
    """Start a stack whose processes all listen on free loopback ports."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = write_rules(workdir / "rules.yaml", rules or e2e_rules())

    def run_of(n: int) -> int:
        while True:
            p = free_port()
            if all(_free(p + i) for i in range(n)):
                return p

    ports = StackPorts(
        envoy=run_of(envoys),
        envoy_admin=run_of(envoys),
        sim=free_port(),
        extproc=run_of(extprocs),
        redis=free_port(),
    )
    stack = Stack(
        config=str(config),
        workdir=workdir,
        ports=ports,
        envoys=envoys,
        extprocs=extprocs,
        redis_url=redis_url,
        sim_args=SIM_ARGS + (sim_args or []),
        **stack_kw,
    )
    stack.start()
    return stack


def _free(port: int) -> bool:
    from extproc.stack import port_in_use

    return not port_in_use(port)


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One Envoy, one processor, the simulator and Redis, shared by the e2e suite."""
    s = make_stack(Path(tmp_path_factory.mktemp("stack")))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two Envoys and two processor replicas sharing one Redis."""
    s = make_stack(Path(tmp_path_factory.mktemp("pair")), envoys=2, extprocs=2)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def rds(stack: Stack) -> Iterator[redis.Redis]:
    """A client of the stack's Redis."""
    client = redis.Redis(port=stack.ports.redis, decode_responses=True)
    yield client
    client.close()


def client(stack: Stack, key: str, *, envoy: int = 0) -> openai.OpenAI:
    """The official SDK pointed at one of the stack's Envoys (no automatic retries)."""
    port = stack.envoy_ports[envoy]
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=30
    )


def usage_flags(stack: Stack, *, admin: bool = False) -> list[str]:
    """``ai-quota usage`` flags that reach the stack's first processor over its TLS (with the
    admin token when ``admin``: any tenant)."""
    c = stack.credentials
    flags = ["--address", f"127.0.0.1:{stack.extproc_ports[0]}"]
    if c is None:
        return flags
    flags += ["--ca-file", str(c.ca), "--server-name", "ai-quota"]
    if admin:
        flags += ["--token-file", str(c.admin_token_file)]
    return flags


def grpc_channel(stack: Stack, port: int | None = None) -> Any:
    """A blocking channel to a processor of the stack, with Envoy's credentials: TLS checked
    against the stack's CA, the client certificate in ``mtls``; the call metadata to send is
    :func:`caller_metadata`."""
    import grpc

    address = f"127.0.0.1:{port or stack.extproc_ports[0]}"
    c = stack.credentials
    if c is None:
        return grpc.insecure_channel(address)
    pair: tuple[bytes, bytes] | tuple[None, None] = (None, None)
    if stack.security == "mtls":
        pair = (c.client_key.read_bytes(), c.client_cert.read_bytes())
    creds = grpc.ssl_channel_credentials(c.ca.read_bytes(), *pair)
    return grpc.secure_channel(
        address, creds, options=[("grpc.ssl_target_name_override", "ai-quota")]
    )


def caller_metadata(stack: Stack) -> tuple[tuple[str, str], ...]:
    """Envoy's bearer token as call metadata (none in ``mtls`` or ``insecure``)."""
    c = stack.credentials
    if c is None or stack.security != "token":
        return ()
    return (("authorization", f"Bearer {c.token}"),)
