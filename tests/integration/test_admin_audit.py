"""Who changed what through the admin API: the audit log written with every change, the
token file followed while it rotates, client certificates (mutual TLS), and the calls counted
in metrics.  Real redis-server, real gRPC servers and clients, certificates made by openssl."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from extproc._gen.aiquota.v1 import admin_pb2, admin_pb2_grpc
from extproc.admin.auth import TokenFile, fingerprint
from extproc.admin.rules import read_file_rules
from extproc.admin.server import start_admin_server
from extproc.admin.service import AdminServicer
from extproc.admin.store import AdminStore
from extproc.admin.sync import StoreSync
from extproc.config.version import config_version
from extproc.metrics import Metrics
from tests.helpers import RedisServer
from tests.integration.test_admin_store import TOKEN, prefix, write_rules

pytestmark = pytest.mark.integration


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def test_every_change_is_audited_with_its_caller(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Each change leaves one audit entry, in the same step as the change: its version, the
    action, the token's fingerprint (never the token), who it was made for and what changed;
    refused calls leave none.  ``ai-quota admin audit`` prints them."""
    store = AdminStore.from_url(redis_server.url, prefix=prefix())
    metrics = Metrics()
    sync = StoreSync(store, read_file_rules(str(write_rules(tmp_path)), config_version), print)
    servicer = AdminServicer(store, sync, metrics=metrics)
    server = await start_admin_server(servicer, token=TOKEN)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = admin_pb2_grpc.AdminStub(channel)
    md = [("authorization", f"Bearer {TOKEN}"), ("x-aiq-actor", "alice@example.com")]

    async def call(name: str, request: Any) -> Any:
        return await getattr(stub, name)(request, metadata=md, timeout=5)

    try:
        limit = admin_pb2.Limit(per="hour", tpm=5_000_000)
        await call("SetTenant", admin_pb2.SetTenantRequest(tenant="t1", plan="pro", limits=[limit]))
        created = await call("CreateKey", admin_pb2.CreateKeyRequest(tenant="t1", name="ci"))
        rotated = await call(
            "RotateKey", admin_pb2.RotateKeyRequest(key_id=created.key_id, grace_seconds=30)
        )
        await call("RevokeKey", admin_pb2.RevokeKeyRequest(key_id=rotated.key_id))
        with pytest.raises(grpc.aio.AioRpcError):  # refused: nothing stored, nothing audited
            await call("SetTenant", admin_pb2.SetTenantRequest(tenant="t2", plan="gold"))
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.GetVersion(admin_pb2.GetVersionRequest(), metadata=[], timeout=5)
        await call("DeleteTenant", admin_pb2.DeleteTenantRequest(tenant="t1"))

        log = await call("ListChanges", admin_pb2.ListChangesRequest())
        actions = [(c.version, c.action) for c in log.changes]
        assert actions == [
            (1, "set_tenant"),
            (2, "create_key"),
            (3, "rotate_key"),
            (4, "revoke_key"),
            (5, "delete_tenant"),
        ]
        assert await store.version() == 5
        for c in log.changes:
            assert c.principal == fingerprint(TOKEN) and TOKEN not in str(c)
            assert c.on_behalf_of == "alice@example.com" and c.peer
            assert c.at_ms > 0 and c.tenant == "t1"
        first, second, third = log.changes[0], log.changes[1], log.changes[2]
        assert json.loads(first.detail) == {
            "plan": "pro",
            "limits": [{"per": "hour", "tpm": 5_000_000}],
            "replaced": False,
        }
        assert (second.key, second.key_id) == ("ci", created.key_id)
        assert json.loads(third.detail) == {"replaces": created.key_id, "grace_seconds": 30.0}
        assert created.api_key not in str(log) and rotated.api_key not in str(log)

        later = await call("ListChanges", admin_pb2.ListChangesRequest(since_version=3))
        assert [c.version for c in later.changes] == [4, 5]
        newest = await call("ListChanges", admin_pb2.ListChangesRequest(limit=2))
        assert [c.version for c in newest.changes] == [4, 5]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call("ListChanges", admin_pb2.ListChangesRequest(limit=5000))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        # the calls, counted by method and status code
        assert sample(metrics, "aiq_admin_calls_total", method="CreateKey", code="OK") == 1
        assert (
            sample(metrics, "aiq_admin_calls_total", method="SetTenant", code="INVALID_ARGUMENT")
            == 1
        )
        assert (
            sample(metrics, "aiq_admin_calls_total", method="GetVersion", code="UNAUTHENTICATED")
            == 1
        )
        assert sample(metrics, "aiq_admin_calls_total", method="ListChanges", code="OK") == 3

        # the CLI prints the same log
        token_file = tmp_path / "admin.token"
        token_file.write_text(TOKEN)
        token_file.chmod(0o600)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "extproc",
            "admin",
            "audit",
            "--address",
            f"127.0.0.1:{server.port}",
            "--token-file",
            str(token_file),
            "--since-version",
            "4",
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err_out = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err_out.decode()
        printed = json.loads(out)
        assert [(c["version"], c["action"]) for c in printed["changes"]] == [("5", "delete_tenant")]
    finally:
        await channel.close()
        await server.stop(0)
        await store.close()


async def test_a_rotated_token_file_takes_effect_without_a_restart(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The server follows its token file: after the file is replaced, the old token is
    refused and the new one accepted; a blanked file refuses everyone."""
    path = tmp_path / "admin.token"
    path.write_text("old-token\n")
    path.chmod(0o600)
    store = AdminStore.from_url(redis_server.url, prefix=prefix())
    sync = StoreSync(store, read_file_rules(str(write_rules(tmp_path)), config_version), print)
    server = await start_admin_server(AdminServicer(store, sync), token=TokenFile(str(path)))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = admin_pb2_grpc.AdminStub(channel)

    async def code_with(token: str) -> grpc.StatusCode:
        try:
            await stub.GetVersion(
                admin_pb2.GetVersionRequest(),
                metadata=[("authorization", f"Bearer {token}")],
                timeout=5,
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    try:
        assert await code_with("old-token") == grpc.StatusCode.OK
        new = tmp_path / "admin.token.new"
        new.write_text("new-token")
        os.replace(new, path)
        assert await code_with("old-token") == grpc.StatusCode.UNAUTHENTICATED
        assert await code_with("new-token") == grpc.StatusCode.OK
        path.write_text("")
        assert await code_with("new-token") == grpc.StatusCode.UNAUTHENTICATED
        assert await code_with("") == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await channel.close()
        await server.stop(0)
        await store.close()


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_pki(d: Path) -> None:
    """A CA, a server certificate for localhost and two client certificates: one the CA
    signed (CN ops-bot) and one self-signed (CN intruder)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl(
        "req", "-x509", *ec, "-days", "1", "-subj", "/CN=aiq-test-ca",
        "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"),
    )  # fmt: skip
    (d / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name, cn, ext in (("server", "localhost", True), ("client", "ops-bot", False)):
        openssl(
            "req", *ec, "-subj", f"/CN={cn}",
            "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"),
        )  # fmt: skip
        sign = ["x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem")]
        sign += ["-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "1"]
        sign += ["-out", str(d / f"{name}.pem")]
        if ext:
            sign += ["-extfile", str(d / "server.ext")]
        openssl(*sign)
    openssl(
        "req", "-x509", *ec, "-days", "1", "-subj", "/CN=intruder",
        "-keyout", str(d / "intruder.key"), "-out", str(d / "intruder.pem"),
    )  # fmt: skip


async def test_client_certificates_authenticate_the_admin_api(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """With --admin-tls-client-ca and no token, off loopback: a client certificate the CA
    signed is served and audited as ``cert:<CN>``; no certificate, or one the CA did not
    sign, gets no connection."""
    make_pki(tmp_path)
    store = AdminStore.from_url(redis_server.url, prefix=prefix())
    sync = StoreSync(store, read_file_rules(str(write_rules(tmp_path)), config_version), print)
    server = await start_admin_server(
        AdminServicer(store, sync),
        host="0.0.0.0",
        tls_cert=str(tmp_path / "server.pem"),
        tls_key=str(tmp_path / "server.key"),
        tls_client_ca=str(tmp_path / "ca.pem"),
    )
    root = (tmp_path / "ca.pem").read_bytes()

    def channel(client: str | None) -> Any:
        key = (tmp_path / f"{client}.key").read_bytes() if client else None
        cert = (tmp_path / f"{client}.pem").read_bytes() if client else None
        creds = grpc.ssl_channel_credentials(root, key, cert)
        return grpc.aio.secure_channel(f"localhost:{server.port}", creds)

    channels = {name: channel(name) for name in ("client", None, "intruder")}
    try:
        ok = admin_pb2_grpc.AdminStub(channels["client"])
        await ok.SetTenant(admin_pb2.SetTenantRequest(tenant="m1", plan="basic"), timeout=5)
        log = await ok.ListChanges(admin_pb2.ListChangesRequest(), timeout=5)
        assert [(c.action, c.principal) for c in log.changes] == [("set_tenant", "cert:ops-bot")]
        for name in (None, "intruder"):
            stub = admin_pb2_grpc.AdminStub(channels[name])
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetVersion(admin_pb2.GetVersionRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert await store.version() == 1

        # the CLI presents a client certificate too
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "extproc", "admin", "version",
            "--address", f"localhost:{server.port}", "--tls-ca", str(tmp_path / "ca.pem"),
            "--tls-cert", str(tmp_path / "client.pem"), "--tls-key", str(tmp_path / "client.key"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        out, err_out = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err_out.decode()
        assert json.loads(out)["store_version"] == "1"
    finally:
        for ch in channels.values():
            await ch.close()
        await server.stop(0)
        await store.close()
