"""rls.lua on a real redis-server and a real three-node Redis Cluster, and the RLS config
reloaded by SIGHUP in a real ``ai-quota serve`` process."""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import redis
from envoy.service.ratelimit.v3 import rls_pb2_grpc

from extproc.limiter.redis import RedisLimiter
from extproc.limiter.rls_counter import RedisRlsCounter
from extproc.rls.load import compile_domains
from extproc.rls.match import plan
from extproc.rls.parse import parse_text
from extproc.rls.request import Descriptor
from extproc.stack import free_port
from tests.helpers import RedisServer, far_ms, spawn
from tests.rls_support import ROOT, request

pytestmark = pytest.mark.integration


def key() -> str:
    """A fresh counter key with its own hash tag."""
    return f"rlstest:{{{uuid.uuid4().hex[:8]}}}:c"


async def test_all_or_nothing(lim: RedisLimiter, redis_server: RedisServer) -> None:
    """One enforced counter over refuses the request and nothing is added anywhere."""
    a, b = key(), key()
    exp = far_ms()
    ok, before = await RedisRlsCounter(lim.caller).rls_check([(a, 3, 5, exp, 1), (b, 4, 5, exp, 1)])
    assert ok and before == [0, 0]
    ok, before = await RedisRlsCounter(lim.caller).rls_check([(a, 1, 5, exp, 1), (b, 2, 5, exp, 1)])
    assert not ok and before == [3, 4]
    r = redis.Redis(port=redis_server.port)
    assert [int(r.get(a) or 0), int(r.get(b) or 0)] == [3, 4]
    assert 0 < r.pttl(a) <= exp - int(time.time() * 1000) + 1000


async def test_repeated_key_sees_the_earlier_hits(lim: RedisLimiter) -> None:
    """The same counter twice in one request: the second sees the first's hits."""
    a = key()
    ok, before = await RedisRlsCounter(lim.caller).rls_check(
        [(a, 2, 3, far_ms(), 1), (a, 2, 3, far_ms(), 1)]
    )
    assert not ok and before == [0, 2]
    ok, before = await RedisRlsCounter(lim.caller).rls_check(
        [(a, 1, 3, far_ms(), 1), (a, 2, 3, far_ms(), 1)]
    )
    assert ok and before == [0, 1]


async def test_shadow_quota_and_check_only(lim: RedisLimiter, redis_server: RedisServer) -> None:
    """Shadow counters never refuse; quota counters refuse only all together; 0 hits adds
    nothing and creates no key."""
    s, q1, q2, c = key(), key(), key(), key()
    exp = far_ms()
    assert (await RedisRlsCounter(lim.caller).rls_check([(s, 10, 1, exp, 0)]))[0]
    assert (await RedisRlsCounter(lim.caller).rls_check([(q1, 2, 1, exp, 2), (q2, 1, 1, exp, 2)]))[
        0
    ] is True
    assert (await RedisRlsCounter(lim.caller).rls_check([(q1, 1, 1, exp, 2), (q2, 1, 1, exp, 2)]))[
        0
    ] is False
    assert (await RedisRlsCounter(lim.caller).rls_check([(c, 0, 1, exp, 1)])) == (True, [0])
    r = redis.Redis(port=redis_server.port)
    assert int(r.get(s) or 0) == 10 and not r.exists(c)


async def test_cluster_one_call_per_slot(cluster: list[int]) -> None:
    """On Redis Cluster a request's counters sharing a hash tag are one call; counters on
    other slots are grouped per slot, each all or nothing."""
    lim = RedisLimiter.from_url(f"redis+cluster://127.0.0.1:{cluster[0]}", timeout_ms=2000)
    try:
        cfg = compile_domains(
            [
                parse_text(
                    "domain: d\ndescriptors:\n  - key: tenant\n    descriptors:\n"
                    "      - key: metric\n        rate_limit: {unit: hour, requests_per_unit: 2}\n",
                    "c.yaml",
                )
            ]
        )
        tenant = f"t{uuid.uuid4().hex[:6]}"
        p = plan(
            cfg,
            "d",
            [
                Descriptor((("tenant", tenant), ("metric", "rpm"))),
                Descriptor((("tenant", tenant), ("metric", "tpm")), hits_addend=2),
            ],
            1,
            int(time.time() * 1000),
        )
        counters = [(c.key, c.hits, c.limit, c.expire_at_ms, c.mode) for c in p.counted]
        before_calls = lim.round_trips
        assert await RedisRlsCounter(lim.caller).rls_check(counters) == (True, [0, 0])
        assert lim.round_trips - before_calls == 1
        assert (await RedisRlsCounter(lim.caller).rls_check(counters))[
            0
        ] is False  # tpm at 2: refused, rpm not added
        other = key()
        before_calls = lim.round_trips
        ok, before = await RedisRlsCounter(lim.caller).rls_check(
            [counters[0], (other, 1, 5, far_ms(), 1)]
        )
        assert ok and before == [1, 0]
        assert lim.round_trips - before_calls == 2
    finally:
        await lim.close()


def test_sighup_reloads_the_rls_config(redis_server: RedisServer, tmp_path: Path) -> None:
    """A real serve process with file watching off picks a changed config up on SIGHUP, and
    keeps it when the next edit is broken."""
    cfg = tmp_path / "rls"
    cfg.mkdir()
    rule = "domain: h\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: {}}}\n"
    (cfg / "h.yaml").write_text(rule.format(5))
    port = free_port()
    env = {
        **os.environ,
        "AIQ_CONFIG": str(ROOT / "tests" / "data" / "config" / "minimal.yaml"),
        "AIQ_REDIS_URL": redis_server.url,
        "AIQ_INSECURE": "1",  # this test is about something else than the door
        "AIQ_GRPC_ADDRESS": f"127.0.0.1:{port}",
        "AIQ_RLS_CONFIG": str(cfg),
        "AIQ_RLS_WATCH_S": "0",
        "AIQ_ADMIN_STORE": "0",
        "AIQ_USAGE_STREAM": "off",
        "AIQ_KEY_PREFIX": f"hup{uuid.uuid4().hex[:6]}",
    }
    proc = spawn([sys.executable, "-m", "extproc", "serve"], tmp_path / "serve.log", env=env)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = rls_pb2_grpc.RateLimitServiceStub(ch)

            def limit() -> int:
                r = stub.ShouldRateLimit(request("h", ([("k", "v")], 0)), timeout=5)
                return int(r.statuses[0].current_limit.requests_per_unit)

            assert wait_value(limit, 5)
            (cfg / "h.yaml").write_text(rule.format(7))
            proc.send_signal(signal.SIGHUP)
            assert wait_value(limit, 7)
            (cfg / "h.yaml").write_text("domain: h\ndescriptors: [oops\n")
            proc.send_signal(signal.SIGHUP)
            log = tmp_path / "serve.log"
            deadline = time.monotonic() + 10
            while "rls_config_reload_failed" not in log.read_text():
                assert time.monotonic() < deadline, "no reload failure logged"
                time.sleep(0.05)
            assert limit() == 7
    finally:
        proc.terminate()
        proc.wait(15)


def wait_value(fn: Callable[[], int], want: int, timeout: float = 20.0) -> bool:
    """Poll ``fn()`` (errors while the server starts count as not yet) until it equals ``want``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if fn() == want:
                return True
        except grpc.RpcError:
            pass
        time.sleep(0.05)
    return False


def test_workers_serve_rls_from_the_flag(redis_server: RedisServer, tmp_path: Path) -> None:
    """`serve --workers 2 --rls-config DIR`: each worker serves the RLS API on the shared
    port, and the counters are one (fresh connections land on either worker)."""
    cfg = tmp_path / "rls"
    cfg.mkdir()
    (cfg / "w.yaml").write_text(
        "domain: w\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 6}\n"
    )
    port = free_port()
    env = {
        **os.environ,
        "AIQ_CONFIG": str(ROOT / "tests" / "data" / "config" / "minimal.yaml"),
        "AIQ_REDIS_URL": redis_server.url,
        "AIQ_INSECURE": "1",  # this test is about something else than the door
        "AIQ_ADMIN_STORE": "0",
        "AIQ_USAGE_STREAM": "off",
        "AIQ_KEY_PREFIX": f"wk{uuid.uuid4().hex[:6]}",
    }
    proc = spawn(
        [
            *(sys.executable, "-m", "extproc", "serve", "--workers", "2"),
            *("--grpc-address", f"127.0.0.1:{port}", "--rls-config", str(cfg)),
        ],
        tmp_path / "serve.log",
        env=env,
    )
    try:

        def call() -> int:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # a new connection each
                stub = rls_pb2_grpc.RateLimitServiceStub(ch)
                r = stub.ShouldRateLimit(request("w", [("k", "v")]), timeout=5)
                return int(r.statuses[0].limit_remaining)

        assert wait_value(call, 5)
        assert [call() for _ in range(5)] == [4, 3, 2, 1, 0]
    finally:
        proc.terminate()
        proc.wait(20)


async def test_a_stalled_check_counts_once(tmp_path: Path) -> None:
    """A check that times out is sent again with the same call id: Redis, once awake, runs
    both and counts the check at most once; the caller got LimiterUnavailable."""
    import asyncio
    import threading

    from extproc.errors import LimiterUnavailable

    server = RedisServer(tmp_path / "redis", extra=["--enable-debug-command", "yes"])
    lim = RedisLimiter.from_url(server.url, timeout_ms=100)
    try:
        a = key()
        await RedisRlsCounter(lim.caller).rls_check(
            [(a, 1, 100, far_ms(), 1)]
        )  # scripts loaded, connection open
        sleeper = threading.Thread(target=_debug_sleep, args=(server.port,))
        sleeper.start()
        await asyncio.to_thread(_wait_blocked, server.port)
        calls = lim.round_trips
        with pytest.raises(LimiterUnavailable):
            await RedisRlsCounter(lim.caller).rls_check([(a, 5, 100, far_ms(), 1)])
        assert lim.round_trips - calls == 2  # the stall retry, same call id
        sleeper.join()
        r = redis.Redis(port=server.port)
        assert int(r.get(a) or 0) in (1, 6)  # ran once after waking, or never; never twice
        r.close()
    finally:
        await lim.close()
        server.stop()


def _debug_sleep(port: int) -> None:
    """Block the server for 0.6 s (DEBUG SLEEP)."""
    with redis.Redis(port=port) as client:
        client.execute_command("DEBUG", "SLEEP", "0.6")


def _wait_blocked(port: int) -> None:
    """Return once a PING goes unanswered for 50 ms (the server is asleep); a raw socket,
    since redis-py retries a timed-out read on its own."""
    import socket

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            sock.settimeout(0.05)
            try:
                sock.recv(16)
            except TimeoutError:
                return
    pytest.fail("the server never blocked")


async def test_an_admitted_check_is_journalled_and_replayed_after_a_failover(
    redis_server: RedisServer,
) -> None:
    """The RLS counter journals an admitted check through its limiter: the replay (the script
    the failover runs, by the name journalled) counts nothing on the master that ran it, and
    on a master that lost it puts back exactly its hits, past the limit if others counted
    meanwhile (replayed as shadow: never refused).  A refused check is not journalled."""
    lim = RedisLimiter.from_url(redis_server.url, timeout_ms=1000)
    r = redis.Redis(port=redis_server.port)
    try:
        counter = RedisRlsCounter(lim.caller)
        a = key()
        assert await counter.rls_check([(a, 4, 5, far_ms(), 1)]) == (True, [0])
        assert (await counter.rls_check([(a, 4, 5, far_ms(), 1)]))[0] is False
        assert lim.failover is not None
        [entry] = [e for e in lim.failover.journal if e.script == "rls"]
        replay = lim.caller.scripts[entry.script]  # what the failover runs for this entry
        await replay(keys=entry.keys, args=entry.args)
        assert int(r.get(a) or 0) == 4  # ran already: nothing more
        r.delete(a, entry.keys[0])  # a new master that never saw the check
        r.set(a, 5)  # ... and other Envoys' hits since
        await replay(keys=entry.keys, args=entry.args)
        assert int(r.get(a) or 0) == 9
    finally:
        r.close()
        await lim.close()
