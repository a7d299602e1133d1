"""The gRPC port's door (extproc.access, docs/security.md), in process over real TLS and a real
redis-server: who may call ext_proc, the RLS API and the usage API, with which credential, and
what a refused caller leaves behind (nothing in Redis, a counted and rate-limited log line)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.service.ratelimit.v3 import rls_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc import devcerts
from extproc.access import PortGuard, check_settings
from extproc.app import Running, start
from extproc.caller_tokens import AccessConfigError
from extproc.settings import Settings
from tests.helpers import RedisServer
from tests.rls_support import OK, SEED_DIR, fake_clock, metric, request

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
UNAUTH = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> devcerts.DevCredentials:
    """A CA, server and client certificates, the caller and admin token files."""
    d = Path(tmp_path_factory.mktemp("creds"))
    made = devcerts.make(d)
    devcerts.client_cert(d, "intruder")
    return made


@pytest.fixture(scope="module")
def rules(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two tenants with a key each, on per-minute limits."""
    path = Path(tmp_path_factory.mktemp("rules")) / "rules.yaml"
    path.write_text(
        """
models:
  sim-small:
    tokenizer: {kind: tiktoken, encoding: cl100k_base}
    max_output_tokens: 1024
plans:
  basic:
    limits:
      - {model: "*", per: minute, rpm: 60, tpm: 100000}
tenants:
  acme:
    plan: basic
    keys: [{name: acme-1, plaintext: sk-acme}]
  globex:
    plan: basic
    keys: [{name: globex-1, plaintext: sk-globex}]
"""
    )
    return path


async def serve(redis_server: RedisServer, rules: Path, **kw: Any) -> tuple[Running, str]:
    """An in-process ``ai-quota serve`` with the seed RLS config; (running, key prefix)."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    settings = Settings(
        config=str(rules),
        redis_url=redis_server.url,
        grpc_address="127.0.0.1:0",
        key_prefix=prefix,
        admin_store=False,
        usage_stream="off",
        rls_config=str(SEED_DIR),
        rls_watch_s=0,
        **kw,
    )
    return await start(settings, clock=fake_clock()), prefix


def tls_channel(port: int, creds: devcerts.DevCredentials, client: str = "") -> Any:
    """A TLS channel that checks the server against the local CA (client certificate
    ``client``: the one of that name in the credentials' directory)."""
    pair: tuple[bytes, bytes] | tuple[None, None] = (None, None)
    if client:
        pair = (
            (creds.dir / f"{client}.key").read_bytes(),
            (creds.dir / f"{client}.pem").read_bytes(),
        )
    c = grpc.ssl_channel_credentials(creds.ca.read_bytes(), *pair)
    return grpc.aio.secure_channel(
        f"127.0.0.1:{port}", c, options=[("grpc.ssl_target_name_override", "ai-quota")]
    )


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def process_code(ch: Any, metadata: Any = None) -> grpc.StatusCode:
    """The status of an ext_proc Process stream that sends request headers."""
    stub = ep_grpc.ExternalProcessorStub(ch)
    call = stub.Process(metadata=metadata)
    try:
        # the server may refuse before reading: a write can then meet the finished call
        await call.write(ep_pb.ProcessingRequest(request_headers=ep_pb.HttpHeaders()))
        await call.done_writing()
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    except asyncio.InvalidStateError:
        pass
    return await call.code()


async def rls_code(ch: Any, metadata: Any = None, hits: int = 1) -> grpc.StatusCode:
    stub = rls_pb2_grpc.RateLimitServiceStub(ch)
    seed = [("tenant", "acme"), ("model", "sim-small"), ("metric", "tpm")]
    try:
        resp = await stub.ShouldRateLimit(
            request("ai-gateway", seed, hits=hits), metadata=metadata, timeout=5
        )
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    assert resp.overall_code == OK
    return grpc.StatusCode.OK


async def usage(ch: Any, metadata: Any = None, **req: str) -> Any:
    """GetUsage's answer, or its status code when refused."""
    from extproc._gen.aiquota.v1 import usage_pb2, usage_pb2_grpc

    stub = usage_pb2_grpc.UsageStub(ch)
    try:
        return await stub.GetUsage(usage_pb2.GetUsageRequest(**req), metadata=metadata, timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()


@pytest.fixture
async def token_port(
    redis_server: RedisServer, rules: Path, creds: devcerts.DevCredentials
) -> AsyncIterator[tuple[Running, str]]:
    """TLS + caller token file + the admin token for usage."""
    running, prefix = await serve(
        redis_server,
        rules,
        grpc_token_file=str(creds.token_file),
        grpc_tls_cert=str(creds.server_cert),
        grpc_tls_key=str(creds.server_key),
        admin_token_file=str(creds.admin_token_file),
    )
    yield running, prefix
    await running.stop(1.0)


async def test_without_credentials_every_service_but_health_is_refused(
    token_port: tuple[Running, str], creds: devcerts.DevCredentials
) -> None:
    """Without Envoy's token, Process, ShouldRateLimit and GetUsage are UNAUTHENTICATED (counted per service and reason); health answers."""
    running, _ = token_port
    async with tls_channel(running.port, creds) as ch:
        assert await process_code(ch) == UNAUTH
        assert await rls_code(ch) == UNAUTH
        assert await usage(ch, tenant="acme") == UNAUTH
        assert await process_code(ch, bearer("not-the-token")) == UNAUTH
        assert await rls_code(ch, bearer(creds.admin_token)) == UNAUTH  # admin is not Envoy
        health = health_pb2_grpc.HealthStub(ch)
        answer = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert answer.status in (health_pb2.HealthCheckResponse.SERVING, 2)
    refused = "aiq_grpc_refused_total"
    assert metric(running, refused, service="ext_proc", reason="missing") == 1
    assert metric(running, refused, service="ext_proc", reason="wrong_token") == 1
    assert metric(running, refused, service="rls", reason="missing") == 1
    assert metric(running, refused, service="rls", reason="wrong_token") == 1
    assert metric(running, refused, service="usage", reason="missing") == 1


async def test_the_token_serves_ext_proc_and_rls(
    token_port: tuple[Running, str], creds: devcerts.DevCredentials
) -> None:
    """With the caller token, RLS answers and Process gets past the door."""
    running, _ = token_port
    async with tls_channel(running.port, creds) as ch:
        assert await rls_code(ch, bearer(creds.token)) == grpc.StatusCode.OK
        # Process passes the door: what answers is the processor (headers alone, no body)
        assert await process_code(ch, bearer(creds.token)) not in (UNAUTH, DENIED)


async def test_an_unauthenticated_drain_leaves_the_tenant_untouched(
    token_port: tuple[Running, str], creds: devcerts.DevCredentials, redis_server: RedisServer
) -> None:
    """The issue's first attack: ShouldRateLimit(hits_addend=1900) without a credential."""
    running, prefix = token_port
    rds = redis.Redis.from_url(redis_server.url)
    before = {k: rds.get(k) for k in rds.scan_iter(f"{prefix}*")}
    async with tls_channel(running.port, creds) as ch:
        for _ in range(5):
            assert await rls_code(ch, hits=1900) == UNAUTH
    after = {k: rds.get(k) for k in rds.scan_iter(f"{prefix}*")}
    assert after == before == {}
    # and the same call with Envoy's token does count (the test would catch a dead path)
    async with tls_channel(running.port, creds) as ch:
        assert await rls_code(ch, bearer(creds.token), hits=1900) == grpc.StatusCode.OK
    assert sum(int(rds.get(k) or 0) for k in rds.scan_iter(f"{prefix}*tpm*")) == 1900
    rds.close()


async def test_usage_answers_a_tenant_its_own_usage_and_the_admin_any(
    token_port: tuple[Running, str], creds: devcerts.DevCredentials
) -> None:
    """A tenant's key reads that tenant only (another: PERMISSION_DENIED); the admin token reads any; Envoy's token reads none."""
    running, _ = token_port
    async with tls_channel(running.port, creds) as ch:
        own = await usage(ch, bearer("sk-acme"))
        assert not isinstance(own, grpc.StatusCode) and own.tenant == "acme"
        assert (await usage(ch, bearer("sk-acme"), tenant="acme")).tenant == "acme"
        assert (await usage(ch, api_key="sk-acme")).tenant == "acme"  # the key in the request
        assert await usage(ch, bearer("sk-acme"), tenant="globex") == DENIED
        assert await usage(ch, bearer("sk-acme"), api_key="sk-globex") == DENIED
        assert await usage(ch, bearer("sk-nobody"), tenant="acme") == UNAUTH
        assert await usage(ch, api_key="sk-nobody") == UNAUTH
        assert await usage(ch, bearer(creds.token), tenant="acme") == UNAUTH  # Envoy's token
        admin = bearer(creds.admin_token)
        assert (await usage(ch, admin, tenant="globex")).tenant == "globex"
        assert (await usage(ch, admin, api_key="sk-acme")).tenant == "acme"
    refused = "aiq_grpc_refused_total"
    assert metric(running, refused, service="usage", reason="other_tenant") == 2
    assert metric(running, refused, service="usage", reason="wrong_token") == 2
    assert metric(running, refused, service="usage", reason="unknown_key") == 1


async def test_a_rotation_keeps_both_tokens_then_only_the_new(
    redis_server: RedisServer, rules: Path, creds: devcerts.DevCredentials, tmp_path: Path
) -> None:
    """The token file rewritten old+new, then new only, then emptied: the tokens in force follow it without a restart."""
    tokens = tmp_path / "tokens"
    tokens.write_text("old-token\n")
    running, _ = await serve(
        redis_server,
        rules,
        grpc_token_file=str(tokens),
        grpc_tls_cert=str(creds.server_cert),
        grpc_tls_key=str(creds.server_key),
    )
    try:
        async with tls_channel(running.port, creds) as ch:
            assert await rls_code(ch, bearer("old-token")) == grpc.StatusCode.OK
            assert await rls_code(ch, bearer("new-token")) == UNAUTH
            tokens.write_text("# rotating\nold-token\nnew-token\n")
            assert await rls_code(ch, bearer("old-token")) == grpc.StatusCode.OK
            assert await rls_code(ch, bearer("new-token")) == grpc.StatusCode.OK
            tokens.write_text("new-token\n")
            assert await rls_code(ch, bearer("old-token")) == UNAUTH
            assert await rls_code(ch, bearer("new-token")) == grpc.StatusCode.OK
            tokens.write_text("")  # emptied: no token is in force
            assert await rls_code(ch, bearer("new-token")) == UNAUTH
    finally:
        await running.stop(1.0)


async def test_mutual_tls_admits_allowed_sans_only(
    redis_server: RedisServer, rules: Path, creds: devcerts.DevCredentials
) -> None:
    """Mutual TLS: Envoy's certificate (allowed SAN) passes, another of the same CA is PERMISSION_DENIED, none fails the handshake."""
    running, _ = await serve(
        redis_server,
        rules,
        grpc_tls_cert=str(creds.server_cert),
        grpc_tls_key=str(creds.server_key),
        grpc_tls_client_ca=str(creds.ca),
        grpc_allowed_sans="envoy",
    )
    try:
        async with tls_channel(running.port, creds, "envoy") as ch:
            assert await rls_code(ch) == grpc.StatusCode.OK
            assert await process_code(ch) not in (UNAUTH, DENIED)
            # a certificate is not a usage credential: the tenant's key still is
            assert await usage(ch, tenant="acme") == UNAUTH
            assert (await usage(ch, bearer("sk-acme"))).tenant == "acme"
        async with tls_channel(running.port, creds, "intruder") as ch:
            assert await rls_code(ch) == DENIED
            assert await process_code(ch) == DENIED
        async with tls_channel(running.port, creds) as ch:  # no certificate: no handshake
            assert await rls_code(ch) == grpc.StatusCode.UNAVAILABLE
    finally:
        await running.stop(1.0)
    refused = "aiq_grpc_refused_total"
    assert metric(running, refused, service="rls", reason="san_not_allowed") == 1
    assert metric(running, refused, service="ext_proc", reason="san_not_allowed") == 1


async def test_insecure_is_an_explicit_choice(
    redis_server: RedisServer, rules: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No credential: start() refuses unless insecure=True, which serves everyone."""
    with pytest.raises(AccessConfigError, match="--insecure or AIQ_INSECURE=1"):
        await serve(redis_server, rules)
    running, _ = await serve(redis_server, rules, insecure=True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            assert await rls_code(ch) == grpc.StatusCode.OK
            assert (await usage(ch, tenant="globex")).tenant == "globex"
    finally:
        await running.stop(1.0)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"token_file": "t", "tls_cert": "c"}, "go together"),
        ({"client_ca": "ca"}, "needs --grpc-tls-cert"),
        ({"token_file": "t", "allowed_sans": ["envoy"]}, "needs --grpc-tls-client-ca"),
        ({"token_file": "t", "address": "0.0.0.0:50051"}, "in plaintext"),
        # the RLS API's own port takes the same token: held to the same rule
        ({"token_file": "t", "rls_address": "0.0.0.0:50052"}, r"RLS API's own port .*plaintext"),
        ({"token_file": "t", "rls_address": ":50052"}, r"AIQ_RLS_ADDRESS\) on non-loopback"),
        ({}, "needs caller credentials"),
    ],
)
def test_settings_that_would_leave_the_port_open_are_refused(
    kw: dict[str, Any], message: str
) -> None:
    """Incomplete or unsafe settings are refused with a message naming what to set."""
    args: dict[str, Any] = {
        "address": "127.0.0.1:50051",
        "insecure": False,
        "token_file": "",
        "tls_cert": "",
        "tls_key": "",
        "client_ca": "",
        "allowed_sans": [],
        "allow_plaintext": False,
        **kw,
    }
    with pytest.raises(AccessConfigError, match=message):
        check_settings(**args)


class _Ctx:
    def __init__(self, peer: str) -> None:
        self._peer = peer

    def peer(self) -> str:
        return self._peer


def test_refusals_are_logged_once_a_minute_per_peer_and_all_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every refusal is counted with bounded labels; each peer host is logged at most once a minute; the log memory is bounded."""
    from prometheus_client import CollectorRegistry, Counter

    reg = CollectorRegistry()
    counter = Counter("refused", "", ["service", "reason"], registry=reg)
    now = [1000.0]
    guard = PortGuard(refused=counter, clock=lambda: now[0])
    with structlog.testing.capture_logs() as logs:
        for port in range(100):  # one host, many connections
            guard.note(_Ctx(f"ipv4:10.0.0.7:{40000 + port}"), "x.y", "missing")
        guard.note(_Ctx("ipv4:10.0.0.8:1"), "envoy.service.ratelimit.v3.RateLimitService", "odd")
        now[0] += 61
        guard.note(_Ctx("ipv4:10.0.0.7:1"), "aiquota.v1.Usage", "other_tenant")
        logged = [e["peer"] for e in logs if e["event"] == "grpc_call_refused"]
    assert logged == ["10.0.0.7", "10.0.0.8", "10.0.0.7"]
    assert reg.get_sample_value("refused_total", {"service": "other", "reason": "missing"}) == 100
    assert reg.get_sample_value("refused_total", {"service": "rls", "reason": "other"}) == 1
    for p in range(10_000):  # distinct peers: the memory of who was logged stays bounded
        guard.note(_Ctx(f"ipv4:10.1.{p // 256}.{p % 256}:1"), "x.y", "missing")
    assert len(guard._logged) <= 4096


async def test_a_plaintext_health_port_serves_health_only(
    redis_server: RedisServer, rules: Path, creds: devcerts.DevCredentials
) -> None:
    """AIQ_HEALTH_ADDRESS: the kubelet's gRPC probes (no TLS) reach grpc.health.v1 and nothing
    else, while the main port is TLS-only."""
    from extproc.stack import free_port

    port = free_port()
    running, _ = await serve(
        redis_server,
        rules,
        grpc_token_file=str(creds.token_file),
        grpc_tls_cert=str(creds.server_cert),
        grpc_tls_key=str(creds.server_key),
        health_address=f"127.0.0.1:{port}",
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            answer = await health.Check(health_pb2.HealthCheckRequest(service=EXT_PROC), timeout=5)
            assert answer.status in (
                health_pb2.HealthCheckResponse.SERVING,
                health_pb2.HealthCheckResponse.NOT_SERVING,
            )
            assert await rls_code(ch, bearer(creds.token)) == grpc.StatusCode.UNIMPLEMENTED
            assert await usage(ch, tenant="acme") == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await running.stop(1.0)


EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"


async def test_a_renewed_certificate_is_served_without_a_restart(
    redis_server: RedisServer, rules: Path, tmp_path: Path
) -> None:
    """The certificate and key files replaced (another CA's): the next connection's handshake
    presents the new certificate; a client trusting only the old CA no longer connects."""
    import shutil

    first = devcerts.make(tmp_path / "first")
    second = devcerts.make(tmp_path / "second")
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(first.server_cert, live / "tls.crt")
    shutil.copy(first.server_key, live / "tls.key")
    running, _ = await serve(
        redis_server,
        rules,
        grpc_token_file=str(first.token_file),
        grpc_tls_cert=str(live / "tls.crt"),
        grpc_tls_key=str(live / "tls.key"),
    )
    try:
        async with tls_channel(running.port, first) as ch:
            assert await rls_code(ch, bearer(first.token)) == grpc.StatusCode.OK
        # a renewal writes new files and renames them over the old ones, one after the other:
        # a handshake in between meets a key that is not the certificate's and keeps the old
        shutil.copy(second.server_key, live / "new.key")
        shutil.copy(second.server_cert, live / "new.crt")
        (live / "new.key").replace(live / "tls.key")
        async with tls_channel(running.port, first) as ch:
            assert await rls_code(ch, bearer(first.token)) == grpc.StatusCode.OK
        (live / "new.crt").replace(live / "tls.crt")
        async with tls_channel(running.port, second) as ch:
            assert await rls_code(ch, bearer(first.token)) == grpc.StatusCode.OK
        async with tls_channel(running.port, first) as ch:
            assert await rls_code(ch, bearer(first.token)) == grpc.StatusCode.UNAVAILABLE
    finally:
        await running.stop(1.0)


def test_local_credentials_are_kept_until_they_near_expiry(tmp_path: Path) -> None:
    """`ai-quota up` keeps .run/credentials across runs, and makes a new set when the
    certificates expire within a day."""
    first = devcerts.make(tmp_path / "c")
    again = devcerts.make(tmp_path / "c")
    assert again.token == first.token and again.ca.read_bytes() == first.ca.read_bytes()
    short = devcerts.make(tmp_path / "short", days=1)  # valid for less than a day and a second
    renewed = devcerts.make(tmp_path / "short")
    assert renewed.token != short.token
    assert (tmp_path / "c").stat().st_mode & 0o077 == 0  # only the owner reads them


async def test_the_rls_api_on_its_own_address_has_the_same_door(
    redis_server: RedisServer, rules: Path, creds: devcerts.DevCredentials
) -> None:
    """AIQ_RLS_ADDRESS: the RLS API's own port serves the same TLS and answers the same
    caller token only."""
    from extproc.stack import free_port

    rls_port = free_port()
    running, _ = await serve(
        redis_server,
        rules,
        grpc_token_file=str(creds.token_file),
        grpc_tls_cert=str(creds.server_cert),
        grpc_tls_key=str(creds.server_key),
        rls_address=f"127.0.0.1:{rls_port}",
    )
    try:
        assert running.rls_port == rls_port
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rls_port}") as ch:
            assert await rls_code(ch, bearer(creds.token)) == grpc.StatusCode.UNAVAILABLE
        async with tls_channel(rls_port, creds) as ch:
            assert await rls_code(ch, hits=1900) == UNAUTH
            assert await rls_code(ch, bearer(creds.token)) == grpc.StatusCode.OK
    finally:
        await running.stop(1.0)
    assert metric(running, "aiq_grpc_refused_total", service="rls", reason="missing") == 1


@pytest.mark.parametrize(
    "kw",
    [
        {"rls_address": "127.0.0.1:50052"},  # loopback: the token stays on the machine
        {"rls_address": "0.0.0.0:50052", "tls_cert": "c", "tls_key": "k"},  # TLS there too
        {"rls_address": "0.0.0.0:50052", "allow_plaintext": True},  # a mesh terminates TLS
        {"rls_address": "0.0.0.0:50052", "insecure": True, "token_file": ""},  # no token at all
    ],
)
def test_an_rls_port_off_loopback_is_allowed_only_without_a_plaintext_token(
    kw: dict[str, Any],
) -> None:
    """What the refusal above leaves allowed: loopback, TLS, a mesh's TLS, no token."""
    args: dict[str, Any] = {
        "address": "127.0.0.1:50051",
        "insecure": False,
        "token_file": "t",
        "tls_cert": "",
        "tls_key": "",
        "client_ca": "",
        "allowed_sans": [],
        "allow_plaintext": False,
        **kw,
    }
    check_settings(**args)


async def test_an_rls_port_off_loopback_with_a_plaintext_token_does_not_start(
    redis_server: RedisServer, rules: Path, creds: devcerts.DevCredentials
) -> None:
    """AIQ_RLS_ADDRESS on 0.0.0.0 with a caller token and no TLS: start() refuses before
    binding anything (the main port on loopback does not make the RLS port safe), and
    ``ai-quota serve`` exits 2 naming the variable.  Without an RLS config the address is
    ignored (nothing is bound there), so it is not refused."""
    import subprocess
    import sys

    from extproc.stack import free_port, port_in_use

    main_port, rls_port = free_port(), free_port()
    with pytest.raises(AccessConfigError, match=r"AIQ_RLS_ADDRESS\) on non-loopback"):
        await serve(
            redis_server,
            rules,
            grpc_token_file=str(creds.token_file),
            rls_address=f"0.0.0.0:{rls_port}",
        )
    assert not port_in_use(rls_port)
    proc = subprocess.run(
        [sys.executable, "-m", "extproc", "serve"],
        check=False,
        env={
            "PATH": "/usr/bin:/bin",
            "AIQ_CONFIG": str(rules),
            "AIQ_GRPC_ADDRESS": f"127.0.0.1:{main_port}",
            "AIQ_GRPC_TOKEN_FILE": str(creds.token_file),
            "AIQ_RLS_CONFIG": str(SEED_DIR),
            "AIQ_RLS_ADDRESS": f"0.0.0.0:{rls_port}",
            "AIQ_REDIS_URL": redis_server.url,
        },
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr
    assert "AIQ_RLS_ADDRESS" in proc.stderr and "plaintext" in proc.stderr
    assert "Traceback" not in proc.stderr
