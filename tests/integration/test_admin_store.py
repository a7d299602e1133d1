"""The admin store on a real Redis: atomic versioned snapshots, the admin gRPC API with its
bearer token, propagation to replicas (pub/sub, and the version poll for one that missed the
message), and ``ai-quota serve`` wiring (CLI, SIGHUP re-merge, the config version)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import yaml

from extproc._gen.aiquota.v1 import admin_pb2, admin_pb2_grpc
from extproc.admin.errors import AdminConfigError
from extproc.admin.rules import Effective, read_file_rules
from extproc.admin.server import start_admin_server
from extproc.admin.service import AdminServicer
from extproc.admin.state import StoredTenant, StoreState
from extproc.admin.store import AdminStore
from extproc.admin.sync import StoreSync
from extproc.app import reload_rules, start
from extproc.config.load import key_digest
from extproc.config.version import config_version
from extproc.metrics import Metrics
from extproc.settings import Settings
from extproc.stack import free_port
from tests.helpers import RedisServer

pytestmark = pytest.mark.integration

RULES: dict[str, Any] = {
    "models": {"m": {"tokenizer": {"kind": "estimate"}, "max_output_tokens": 1000}},
    "plans": {
        "basic": {"limits": [{"model": "*", "rpm": 60, "tpm": 100000}]},
        "pro": {"limits": [{"model": "*", "rpm": 600, "tpm": 1000000}]},
    },
    "tenants": {"acme": {"plan": "basic", "keys": [{"name": "acme-1", "plaintext": "sk-acme"}]}},
}
TOKEN = "admin-token-for-tests"


def write_rules(tmp_path: Path, doc: dict[str, Any] | None = None) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(doc or RULES))
    return path


def prefix() -> str:
    return "adm" + uuid.uuid4().hex[:8]


class Replica:
    """A replica's view: the config its sync swapped in last."""

    def __init__(self) -> None:
        self.eff: Effective | None = None

    def apply(self, eff: Effective) -> None:
        self.eff = eff

    def knows(self, secret: str) -> bool:
        """Whether the replica's rules accept this key."""
        return self.eff is not None and key_digest(secret) in self.eff.config.keys_by_digest

    def forgot(self, secret: str) -> bool:
        """Whether the replica's rules no longer accept this key."""
        return not self.knows(secret)


#: How long a test waits for an event before failing: generous, the machine may be busy.  The
#: 1 s propagation bound of docs/admin.md is measured by the bench (``scripts/bench --only admin``).
EVENT_S = 15.0


async def within(seconds: float, check: Callable[[], bool]) -> float:
    """Seconds until ``check()`` holds (fails after ``seconds``)."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > seconds:
            raise AssertionError(f"not within {seconds} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


async def subscribed(ports: list[int], channel: str, count: int) -> None:
    """Wait until ``count`` clients subscribe to ``channel`` (summed over the Redis nodes at
    ``ports``: on a cluster each subscriber is on one node)."""

    def numsub() -> int:
        total = 0
        for port in ports:
            with redis.Redis(port=port) as r:
                total += sum(int(n) for _ch, n in r.pubsub_numsub(channel))
        return total

    deadline = time.monotonic() + EVENT_S
    while (n := await asyncio.to_thread(numsub)) < count:
        assert time.monotonic() < deadline, f"{n} of {count} subscriptions on {channel}"
        await asyncio.sleep(0.02)


class Admin:
    def __init__(self, stub: Any, store: AdminStore, rules_path: Path) -> None:
        self.stub, self.store, self.rules_path = stub, store, rules_path
        self.md = [("authorization", f"Bearer {TOKEN}")]

    async def call(self, name: str, request: Any) -> Any:
        return await getattr(self.stub, name)(request, metadata=self.md, timeout=5)


@contextlib.asynccontextmanager
async def admin_api(redis_server: RedisServer, tmp_path: Path) -> AsyncIterator[Admin]:
    """An admin server over a fresh store prefix, and its replica's sync (poll only)."""
    path = write_rules(tmp_path)
    store = AdminStore.from_url(redis_server.url, prefix=prefix())
    sync = StoreSync(store, read_file_rules(str(path), config_version), lambda _e: None)
    server = await start_admin_server(AdminServicer(store, sync), token=TOKEN)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield Admin(admin_pb2_grpc.AdminStub(channel), store, path)
    finally:
        await channel.close()
        await server.stop(0)
        await store.close()


async def test_store_changes_are_versioned_atomic_and_published(
    redis_server: RedisServer,
) -> None:
    """Concurrent changes each get a version, none is lost, each is published and kept in history."""
    store = AdminStore.from_url(redis_server.url, prefix=prefix())
    listener = redis.Redis(port=redis_server.port, decode_responses=True)
    pubsub = listener.pubsub()
    pubsub.subscribe(store.channel)
    try:
        assert await store.version() == 0
        assert (await store.load()).empty

        async def add(tid: str) -> int:
            def change(state: StoreState) -> tuple[StoreState, None]:
                tenants = {**state.tenants, tid: StoredTenant("basic")}
                return StoreState(state.version, tenants, state.keys), None

            stored, _ = await store.update(change)
            return stored.version

        # concurrent writers: compare-and-set retries, nothing is lost
        versions = await asyncio.gather(*(add(f"t{i}") for i in range(8)))
        assert sorted(versions) == list(range(1, 9))
        state = await store.load()
        assert state.version == 8 == await store.version()
        assert set(state.tenants) == {f"t{i}" for i in range(8)}
        client = redis_server.client()
        history = json.loads(client.get(store.history_key(3)) or "null")
        assert history["version"] == 3 and len(history["tenants"]) == 3
        assert 0 < client.ttl(store.history_key(3)) <= 7 * 24 * 3600
        assert all(
            str(k).startswith(f"{{{store.prefix}:admin}}") for k in client.keys(f"*{store.prefix}*")
        )
        published: list[int] = []
        deadline = time.monotonic() + 2
        while len(published) < 8 and time.monotonic() < deadline:
            msg = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
            if msg:
                published.append(int(msg["data"]))
        assert sorted(published) == list(range(1, 9))
    finally:
        pubsub.close()
        listener.close()
        await store.close()


async def test_admin_api_refuses_a_wrong_or_missing_token(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """A wrong, missing or scheme-less token is UNAUTHENTICATED and writes nothing."""
    async with admin_api(redis_server, tmp_path) as admin:
        for md in ([], [("authorization", "Bearer nope")], [("authorization", TOKEN)]):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await admin.stub.GetVersion(admin_pb2.GetVersionRequest(), metadata=md, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.stub.CreateKey(
                admin_pb2.CreateKeyRequest(tenant="acme", name="x"), metadata=[], timeout=5
            )
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert await admin.store.version() == 0  # nothing was written
        ok = await admin.call("GetVersion", admin_pb2.GetVersionRequest())
        assert ok.store_version == 0


async def test_admin_api_refuses_an_unsafe_listener(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """A non-loopback listener without a token or TLS is refused at start."""
    store = AdminStore.from_url(redis_server.url, prefix=prefix())
    rules = read_file_rules(str(write_rules(tmp_path)), config_version)
    servicer = AdminServicer(store, StoreSync(store, rules, lambda _e: None))
    try:
        with pytest.raises(AdminConfigError, match="needs credentials"):
            await start_admin_server(servicer, host="0.0.0.0", token=None)
        with pytest.raises(AdminConfigError, match="plaintext"):
            await start_admin_server(servicer, host="0.0.0.0", token=TOKEN)
        with pytest.raises(AdminConfigError, match="go together"):
            await start_admin_server(servicer, token=TOKEN, tls_cert="c.pem")
    finally:
        await store.close()


async def test_admin_api_calls(redis_server: RedisServer, tmp_path: Path) -> None:
    """Every admin call works, and refusals write nothing."""
    async with admin_api(redis_server, tmp_path) as admin:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.call("SetTenant", admin_pb2.SetTenantRequest(tenant="new", plan="gold"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown plan 'gold'" in (err.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.call(
                "SetTenant",
                admin_pb2.SetTenantRequest(
                    tenant="new", plan="basic", limits=[admin_pb2.Limit(per="fortnight", rpm=1)]
                ),
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.call("CreateKey", admin_pb2.CreateKeyRequest(tenant="nobody", name="k"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        for tenant, name in (("-bad", "k"), ("new", "bad name")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await admin.call("CreateKey", admin_pb2.CreateKeyRequest(tenant=tenant, name=name))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert await admin.store.version() == 0  # refused calls write nothing

        limit = admin_pb2.Limit(model="m", per="hour", tpm=5000)
        done = await admin.call(
            "SetTenant", admin_pb2.SetTenantRequest(tenant="new", plan="pro", limits=[limit])
        )
        assert done.version == 1
        created = await admin.call("CreateKey", admin_pb2.CreateKeyRequest(tenant="new", name="ci"))
        assert created.api_key.startswith("sk-aiq-") and created.key_id.startswith("key_")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.call("CreateKey", admin_pb2.CreateKeyRequest(tenant="new", name="ci"))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        # the store holds the digest only
        raw = redis_server.client().get(admin.store.snapshot_key) or ""
        assert (
            isinstance(raw, str)
            and created.api_key not in raw
            and key_digest(created.api_key) in raw
        )

        got = await admin.call("GetTenant", admin_pb2.GetTenantRequest(tenant="new"))
        assert (got.plan, got.source) == ("pro", "store")
        assert [(k.key_id, k.name) for k in got.keys] == [(created.key_id, "ci")]
        assert got.limits[0].tpm == 5000 and not got.limits[0].HasField("rpm")
        assert key_digest(created.api_key) not in str(got)

        rotated = await admin.call(
            "RotateKey", admin_pb2.RotateKeyRequest(key_id=created.key_id, grace_seconds=60)
        )
        assert rotated.revoked_key_id == created.key_id and rotated.name == "ci"
        assert rotated.api_key != created.api_key
        assert rotated.old_key_expires_at > time.time() + 50
        listed = await admin.call("ListTenants", admin_pb2.ListTenantsRequest())
        by_id = {t.tenant: t for t in listed.tenants}
        assert set(by_id) == {"acme", "new"} and by_id["acme"].source == "file"
        assert len(by_id["new"].keys) == 2  # the old one until its grace ends

        await admin.call("RevokeKey", admin_pb2.RevokeKeyRequest(key_id=created.key_id))
        await admin.call(
            "SetTenant", admin_pb2.SetTenantRequest(tenant="acme", plan="pro")
        )  # override a file tenant
        acme = await admin.call("GetTenant", admin_pb2.GetTenantRequest(tenant="acme"))
        assert (acme.plan, acme.source) == ("pro", "store+file")
        await admin.call("DeleteTenant", admin_pb2.DeleteTenantRequest(tenant="new"))
        state = await admin.store.load()
        assert set(state.tenants) == {"acme"} and not state.keys
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin.call("RevokeKey", admin_pb2.RevokeKeyRequest(key_id=rotated.key_id))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        version = await admin.call("GetVersion", admin_pb2.GetVersionRequest())
        assert version.store_version == state.version


async def test_two_subscribed_replicas_and_a_polling_one_see_a_new_key_and_its_revocation(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Two replicas told by pub/sub (their 60 s poll cannot be what told them) and one that
    only polls see a new key and its revocation."""
    async with admin_api(redis_server, tmp_path) as admin:
        rules = read_file_rules(str(admin.rules_path), config_version)
        replicas = [Replica(), Replica(), Replica()]
        stores = [
            AdminStore.from_url(redis_server.url, prefix=admin.store.prefix) for _ in replicas
        ]
        syncs = [
            # two replicas on pub/sub alone (their poll is too slow to matter here) ...
            StoreSync(stores[0], rules, replicas[0].apply, poll_s=60),
            StoreSync(stores[1], rules, replicas[1].apply, poll_s=60),
            # ... and one that never gets the message: the version poll catches it up
            StoreSync(stores[2], rules, replicas[2].apply, poll_s=0.5, subscribe=False),
        ]
        try:
            for s in syncs:
                await s.start()
            await subscribed([redis_server.port], admin.store.channel, 2)
            created = await admin.call(
                "CreateKey", admin_pb2.CreateKeyRequest(tenant="acme", name="acme-2")
            )
            secret = created.api_key
            for r in replicas:
                await within(EVENT_S, partial(r.knows, secret))
            assert syncs[2].state.version == created.version
            eff = replicas[0].eff
            assert eff is not None and eff.version != rules.version
            assert all(r.eff is not None and r.eff.version == eff.version for r in replicas)

            await admin.call("RevokeKey", admin_pb2.RevokeKeyRequest(key_id=created.key_id))
            for r in replicas:
                await within(EVENT_S, partial(r.forgot, secret))
            assert all(r.knows("sk-acme") for r in replicas)  # the file's key throughout
        finally:
            for s in syncs:
                await s.stop()
            for st in stores:
                await st.close()


async def test_a_rotated_key_ends_with_its_grace(redis_server: RedisServer, tmp_path: Path) -> None:
    """A rotated key keeps working during its grace and stops after it."""
    async with admin_api(redis_server, tmp_path) as admin:
        rules = read_file_rules(str(admin.rules_path), config_version)
        replica = Replica()
        store = AdminStore.from_url(redis_server.url, prefix=admin.store.prefix)
        sync = StoreSync(store, rules, replica.apply, poll_s=0.1)
        try:
            await sync.start()
            old = await admin.call("CreateKey", admin_pb2.CreateKeyRequest(tenant="acme", name="r"))
            new = await admin.call(
                "RotateKey", admin_pb2.RotateKeyRequest(key_id=old.key_id, grace_seconds=1.0)
            )
            await within(EVENT_S, lambda: replica.knows(new.api_key))
            assert replica.knows(old.api_key)  # in its grace
            ends = await within(2.0, lambda: not replica.knows(old.api_key))
            assert ends > 0.3
            assert replica.knows(new.api_key)
        finally:
            await sync.stop()
            await store.close()


async def test_a_replica_keeps_its_snapshot_while_redis_is_down(tmp_path: Path) -> None:
    """A replica keeps its last snapshot while Redis does not answer."""
    server = RedisServer(tmp_path / "redis")
    rules = read_file_rules(str(write_rules(tmp_path)), config_version)
    replica = Replica()
    store = AdminStore.from_url(server.url, prefix=prefix(), timeout_s=0.3)
    metrics = Metrics()
    sync = StoreSync(store, rules, replica.apply, poll_s=0.1, metrics=metrics)
    try:
        secret = "sk-stored"

        def change(state: StoreState) -> tuple[StoreState, None]:
            from extproc.admin.state import StoredKey

            k = StoredKey("key_x", "x", "acme", key_digest(secret), time.time())
            return StoreState(state.version, state.tenants, {k.id: k}), None

        await store.update(change)
        await sync.start()
        assert replica.knows(secret)
        assert metrics.registry.get_sample_value("aiq_admin_store_reachable") == 1
        server.stop()
        # the poll has failed (the replica says so) ...
        await within(
            EVENT_S, lambda: metrics.registry.get_sample_value("aiq_admin_store_reachable") == 0
        )
        # ... and the snapshot is still in force
        assert replica.knows(secret) and sync.state.version == 1
    finally:
        await sync.stop()
        await store.close()
        server.stop()


async def test_serve_with_the_admin_api(redis_server: RedisServer, tmp_path: Path) -> None:
    """``start()`` follows the store and serves the admin API; the CLI drives it; a SIGHUP
    reload of the file merges the store again; the config version covers both."""
    from extproc.cli import main

    path = write_rules(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    admin_port = free_port()
    settings = Settings(
        config=str(path),
        redis_url=redis_server.url,
        grpc_address="127.0.0.1:0",
        key_prefix=prefix(),
        usage_stream="off",
        admin_port=admin_port,
        admin_token_file=str(token_file),
        insecure=True,
    )
    running = await start(settings)
    gw = running.gateway
    file_version = config_version(path.read_text())

    def cli(*argv: str) -> tuple[int, Any]:
        import io
        from contextlib import redirect_stdout

        out = io.StringIO()
        with redirect_stdout(out):
            code = main(
                [
                    "admin",
                    *argv,
                    "--address",
                    f"127.0.0.1:{admin_port}",
                    "--token-file",
                    str(token_file),
                ]
            )
        # (the in-process server's own log lines may land in the same stdout)
        lines = out.getvalue().splitlines()
        if code != 0:
            return code, None
        first, last = lines.index("{"), len(lines) - lines[::-1].index("}")
        return code, json.loads("\n".join(lines[first:last]))

    try:
        code, made = await asyncio.to_thread(
            cli,
            "set-tenant",
            "--tenant",
            "team",
            "--plan",
            "pro",
            "--limit",
            "{per: minute, tpm: 5000}",
        )
        assert code == 0 and made["version"] == "1"  # int64 is a string in proto JSON
        code, key = await asyncio.to_thread(cli, "create-key", "--tenant", "team", "--name", "k1")
        assert code == 0
        await within(EVENT_S, lambda: key_digest(key["api_key"]) in gw.config.keys_by_digest)
        assert gw.config.tenants["team"].plan == "pro"
        code, version = await asyncio.to_thread(cli, "version")
        assert version["config_version"] != file_version == version["file_version"]
        published = {
            s.labels["version"]
            for s in next(iter(gw.metrics.config_version.collect())).samples
            if s.value == 1
        }
        assert published == {version["config_version"]}
        code, got = await asyncio.to_thread(cli, "get", "--tenant", "team")
        assert [k["name"] for k in got["keys"]] == ["k1"] and "sha256" not in json.dumps(got)
        code, _ = await asyncio.to_thread(cli, "set-tenant", "--tenant", "x", "--plan", "gold")
        assert code == 1

        # SIGHUP: a new file version, the store merged in again
        doc = json.loads(json.dumps(RULES))
        doc["plans"]["pro"]["limits"][0]["rpm"] = 700
        write_rules(tmp_path, doc)
        assert reload_rules(running, str(path))
        assert key_digest(key["api_key"]) in gw.config.keys_by_digest
        team = {(lim.metric, lim.limit) for lim in gw.config.tenants["team"].limits}
        assert team == {("rpm", 700), ("tpm", 5000)}

        code, _ = await asyncio.to_thread(cli, "revoke-key", key["key_id"])
        assert code == 0
        await within(EVENT_S, lambda: key_digest(key["api_key"]) not in gw.config.keys_by_digest)
    finally:
        await running.stop(0.5)


async def test_admin_api_over_tls(redis_server: RedisServer, tmp_path: Path) -> None:
    """With a certificate and key, the admin API speaks TLS: a client trusting that certificate
    and carrying the token is served; a plaintext client is not."""
    cert, key = tmp_path / "admin.pem", tmp_path / "admin.key"
    argv = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    argv += ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"]
    argv += ["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"]
    subprocess.run(
        argv,
        check=True,
        capture_output=True,
    )
    store = AdminStore.from_url(redis_server.url, prefix=prefix())
    rules = read_file_rules(str(write_rules(tmp_path)), config_version)
    servicer = AdminServicer(store, StoreSync(store, rules, lambda _e: None))
    server = await start_admin_server(
        servicer, host="0.0.0.0", token=TOKEN, tls_cert=str(cert), tls_key=str(key)
    )
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    secure = grpc.aio.secure_channel(f"localhost:{server.port}", creds)
    plain = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        ok = await admin_pb2_grpc.AdminStub(secure).GetVersion(
            admin_pb2.GetVersionRequest(),
            metadata=[("authorization", f"Bearer {TOKEN}")],
            timeout=5,
        )
        assert ok.store_version == 0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await admin_pb2_grpc.AdminStub(plain).GetVersion(
                admin_pb2.GetVersionRequest(),
                metadata=[("authorization", f"Bearer {TOKEN}")],
                timeout=5,
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await secure.close()
        await plain.close()
        await server.stop(0)
        await store.close()
