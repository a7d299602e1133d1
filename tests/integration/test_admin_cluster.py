"""The admin store on a real three-node Redis Cluster: every change (snapshot, history copy,
audit entry) is one script in one slot, and replicas follow it through the cluster's pub/sub
(PUBLISH reaches every node) as fast as on one Redis, with the version poll as the backstop."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import grpc
import pytest

from extproc._gen.aiquota.v1 import admin_pb2, admin_pb2_grpc
from extproc.admin.rules import read_file_rules
from extproc.admin.server import start_admin_server
from extproc.admin.service import AdminServicer
from extproc.admin.store import AdminStore
from extproc.admin.sync import StoreSync
from extproc.config.version import config_version
from tests.integration.test_admin_store import (
    EVENT_S,
    TOKEN,
    Replica,
    prefix,
    subscribed,
    within,
    write_rules,
)

pytestmark = pytest.mark.integration


async def test_replicas_on_a_cluster_follow_changes_by_pub_sub_and_by_poll(
    cluster: list[int], tmp_path: Path
) -> None:
    """Two replicas told by the cluster's pub/sub (their 60 s poll cannot be what told them)
    and one that only polls see a new key and its revocation; the store is one slot."""
    url = f"redis+cluster://127.0.0.1:{cluster[0]}"
    pfx = prefix()
    rules = read_file_rules(str(write_rules(tmp_path)), config_version)
    store = AdminStore.from_url(url, prefix=pfx)
    servicer = AdminServicer(store, StoreSync(store, rules, lambda _e: None))
    server = await start_admin_server(servicer, token=TOKEN)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = admin_pb2_grpc.AdminStub(channel)
    md = [("authorization", f"Bearer {TOKEN}")]
    replicas = [Replica(), Replica(), Replica()]
    # each replica with its own cluster client, as separate processes would have
    stores = [AdminStore.from_url(f"redis+cluster://127.0.0.1:{p}", prefix=pfx) for p in cluster]
    syncs = [
        # two replicas on pub/sub alone (a 60 s poll cannot explain a sub-second change) ...
        StoreSync(stores[0], rules, replicas[0].apply, poll_s=60),
        StoreSync(stores[1], rules, replicas[1].apply, poll_s=60),
        # ... and one on the poll alone
        StoreSync(stores[2], rules, replicas[2].apply, poll_s=0.5, subscribe=False),
    ]
    try:
        for s in syncs:
            await s.start()
        await subscribed(cluster, store.channel, 2)
        created = await stub.CreateKey(
            admin_pb2.CreateKeyRequest(tenant="acme", name="acme-c"), metadata=md, timeout=5
        )
        secret = created.api_key
        for r in replicas:
            await within(EVENT_S, partial(r.knows, secret))

        await stub.RevokeKey(
            admin_pb2.RevokeKeyRequest(key_id=created.key_id), metadata=md, timeout=5
        )
        for r in replicas:
            await within(EVENT_S, partial(r.forgot, secret))
        assert all(s.state.version == 2 for s in syncs)

        log = await stub.ListChanges(admin_pb2.ListChangesRequest(), metadata=md, timeout=5)
        assert [c.action for c in log.changes] == ["create_key", "revoke_key"]
        # every key of the store lives in one slot
        slots = {await store.client.cluster_keyslot(k) for k in (
            store.version_key, store.snapshot_key, store.audit_key, store.history_key(2)
        )}  # fmt: skip
        assert len(slots) == 1
    finally:
        for s in syncs:
            await s.stop()
        for st in stores:
            await st.close()
        await channel.close()
        await server.stop(0)
        await store.close()
