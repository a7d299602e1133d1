"""The keys of one tenant's call on a real three-node Redis Cluster all hash to one slot (the
scripts' contract on the Cluster is in ``test_limiter_contract.py``)."""

from __future__ import annotations

import time

import pytest
import redis

from extproc.core.keys import ledger_key, open_key, windowed
from extproc.core.rules import Limit

pytestmark = pytest.mark.integration


def test_every_key_of_a_tenant_lives_in_one_slot(cluster: list[int]) -> None:
    """Counters of every scope and window, the ledger and the open set share one slot."""
    limits = (
        Limit("rpm", 10, 60, "*", "tenant"),
        Limit("tpm", 1000, 60, "*", "tenant"),
        Limit("tpm", 500, 3600, "m", "key"),
        Limit("tpm", 500, 60, "*", "tenant", sliding=True),
        Limit("concurrency", 5, 0, "*", "tenant"),
    )
    buckets = windowed("aiq", "acme", "k1", limits, int(time.time() * 1000))
    led = ledger_key("aiq", "acme", "req-1")
    keys = [b.key for b in buckets] + [b.prev_key for b in buckets if b.prev_key]
    keys += [led, open_key(led)]
    r = redis.Redis(port=cluster[0])
    try:
        assert len({r.cluster("keyslot", k) for k in keys}) == 1
    finally:
        r.close()
