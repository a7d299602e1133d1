"""Usage records on a real redis-server: written once, bounded, exported by time range, read by
a consumer group, kept while Redis is down and written when it returns, flushed on shutdown."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.typing import EncodableT

from extproc.cli import main
from extproc.metrics import Metrics
from extproc.records.export import consume, consume_batches, read_range
from extproc.records.model import UsageRecord
from extproc.records.writer import UsageRecorder
from extproc.stack import free_port
from tests.helpers import RedisServer, spawn

pytestmark = pytest.mark.integration


def stream_key() -> str:
    return f"test:usage:{uuid.uuid4().hex[:8]}"


def rec(i: int, **over: Any) -> UsageRecord:
    values: dict[str, Any] = {
        "request_id": f"req-{i}",
        "tenant": "acme" if i % 2 else "globex",
        "key": "ci",
        "model": "sim-small",
        "api": "chat",
        "input_tokens": 10 + i,
        "output_tokens": 100 + i,
        "ending": "completed",
        "status": 200,
        "admitted_at_ms": 1_700_000_000_000 + i,
        "finished_at_ms": 1_700_000_001_000 + i,
    }
    values.update(over)
    return UsageRecord(**values)


def entries(client: redis.Redis, stream: str) -> list[tuple[str, UsageRecord]]:
    """The stream's entries: (id, record)."""
    rows = client.xrange(stream) or []
    return [
        (i.decode() if isinstance(i, bytes) else str(i), UsageRecord.from_fields(f or {}))
        for i, f in rows
    ]


def outcome(metrics: Metrics, name: str) -> float:
    value = metrics.registry.get_sample_value("aiq_usage_records_total", {"outcome": name})
    return value or 0.0


async def until(cond: Callable[[], bool], timeout: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


class RestartableRedis:
    """A redis-server that can be stopped and started again on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None
        self.proc = spawn(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            self.workdir / "redis.log",
        )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, decode_responses=True)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RestartableRedis]:
    server = RestartableRedis(tmp_path)
    yield server
    server.stop()


# -- writing -------------------------------------------------------------------------------------


async def test_each_record_written_once(redis_server: RedisServer) -> None:
    """300 records in batches of 64: each in the stream once, read back equal, counted."""
    stream, metrics = stream_key(), Metrics()
    recorder = UsageRecorder.from_url(redis_server.url, stream, metrics=metrics, batch_size=64)
    sent = [rec(i) for i in range(300)]
    for r in sent:
        recorder.record(r)
    assert await recorder.close(5.0) == 0
    got = entries(redis_server.client(), stream)
    assert len(got) == 300
    assert len({r.record_id for _, r in got}) == 300
    assert [r.request_id for _, r in got] == [r.request_id for r in sent]
    for (_, back), original in zip(got, sent, strict=True):
        assert back.record_id
        assert back == UsageRecord(**{**_as_dict(original), "record_id": back.record_id})
    assert outcome(metrics, "written") == 300
    assert outcome(metrics, "retried") == outcome(metrics, "dropped") == 0
    assert metrics.registry.get_sample_value("aiq_usage_record_backlog") == 0


def _as_dict(r: UsageRecord) -> dict[str, Any]:
    return {name: getattr(r, name) for name in r.__slots__}


async def test_same_record_id_is_not_written_twice(redis_server: RedisServer) -> None:
    """A record sent again with the same record id (a batch retried after an ambiguous
    failure) adds nothing."""
    stream = stream_key()
    recorder = UsageRecorder.from_url(redis_server.url, stream)
    recorder.record(rec(1, record_id="fixed"))
    await until(lambda: recorder.written == 1)
    recorder.record(rec(1, record_id="fixed"))
    recorder.record(rec(2, record_id="other"))
    await recorder.close(5.0)
    got = entries(redis_server.client(), stream)
    assert [r.record_id for _, r in got] == ["fixed", "other"]


async def test_a_reclaims_record_after_the_requests_own_is_skipped(
    redis_server: RedisServer,
) -> None:
    """A request's own record, then a reclaim's with the same record id (its processor had
    settled it before it died, its draft not yet removed): the reclaim's adds nothing.  The
    other way round (a reclaim, then the live processor's own record) both are written, the
    own one last; and neither is written twice when sent again."""
    stream = stream_key()
    recorder = UsageRecorder.from_url(redis_server.url, stream)
    recorder.record(rec(1, record_id="own-first"))
    await until(lambda: recorder.written == 1)
    recorder.record(rec(1, record_id="own-first", ending="reclaimed"))
    recorder.record(rec(2, record_id="reclaim-first", ending="reclaimed"))
    await until(lambda: recorder.written == 3)
    recorder.record(rec(2, record_id="reclaim-first"))
    await until(lambda: recorder.written == 4)
    recorder.record(rec(2, record_id="reclaim-first"))
    recorder.record(rec(2, record_id="reclaim-first", ending="reclaimed"))
    await recorder.close(5.0)
    got = [(r.record_id, r.ending) for _, r in entries(redis_server.client(), stream)]
    assert got == [
        ("own-first", "completed"),
        ("reclaim-first", "reclaimed"),
        ("reclaim-first", "completed"),
    ]


async def test_stream_length_is_bounded(redis_server: RedisServer) -> None:
    """MAXLEN ~ 20: after 600 records the stream holds about 20 (approximate trimming keeps
    at most one node more), the newest included."""
    stream = stream_key()
    recorder = UsageRecorder.from_url(redis_server.url, stream, maxlen=20, batch_size=50)
    for i in range(600):
        recorder.record(rec(i))
    await recorder.close(5.0)
    client = redis_server.client()
    length = client.xlen(stream)
    assert 20 <= length <= 120
    assert entries(client, stream)[-1][1].request_id == "req-599"


async def test_kept_while_redis_is_down_then_written(own_redis: RestartableRedis) -> None:
    """Redis down: records stay in memory (backlog); when it is back they are written, each
    once, counted as retried."""
    stream, metrics = stream_key(), Metrics()
    recorder = UsageRecorder.from_url(own_redis.url, stream, metrics=metrics, timeout_s=0.3)
    own_redis.stop()
    for i in range(30):
        recorder.record(rec(i))
    await asyncio.sleep(0.5)  # at least one failed attempt
    assert recorder.backlog == 30
    assert metrics.registry.get_sample_value("aiq_usage_record_backlog") == 30
    own_redis.start()
    await until(lambda: recorder.backlog == 0)
    await recorder.close(2.0)
    got = entries(own_redis.client(), stream)
    assert [r.request_id for _, r in got] == [f"req-{i}" for i in range(30)]
    assert outcome(metrics, "retried") == 30
    assert outcome(metrics, "written") == outcome(metrics, "dropped") == 0


async def test_backlog_is_bounded_oldest_dropped(own_redis: RestartableRedis) -> None:
    """With room for 5 while Redis is down, 8 records keep the newest 5 and drop 3 (counted)."""
    stream, metrics = stream_key(), Metrics()
    recorder = UsageRecorder.from_url(
        own_redis.url, stream, metrics=metrics, timeout_s=0.3, max_kept=5
    )
    own_redis.stop()
    for i in range(8):
        recorder.record(rec(i))
    assert recorder.backlog <= 5
    await asyncio.sleep(0.3)
    own_redis.start()
    await until(lambda: recorder.backlog == 0)
    await recorder.close(2.0)
    got = [r.request_id for _, r in entries(own_redis.client(), stream)]
    assert got == [f"req-{i}" for i in range(3, 8)]
    assert outcome(metrics, "dropped") == 3


async def test_stalled_redis_writes_once(own_redis: RestartableRedis) -> None:
    """Redis pausing writes longer than the write timeout: every record still ends up in the
    stream exactly once."""
    stream, metrics = stream_key(), Metrics()
    recorder = UsageRecorder.from_url(
        own_redis.url, stream, metrics=metrics, timeout_s=0.2, batch_size=8
    )
    own_redis.client().execute_command("CLIENT", "PAUSE", "1200", "WRITE")
    for i in range(40):
        recorder.record(rec(i))
    await until(lambda: recorder.backlog == 0)
    await recorder.close(2.0)
    got = [r.request_id for _, r in entries(own_redis.client(), stream)]
    assert sorted(got) == sorted(f"req-{i}" for i in range(40))
    assert outcome(metrics, "retried") > 0  # the pause did make writes time out


async def test_flush_on_shutdown(redis_server: RedisServer) -> None:
    """Records queued just before shutdown are written by flush; later ones are dropped."""
    stream, metrics = stream_key(), Metrics()
    recorder = UsageRecorder.from_url(redis_server.url, stream, metrics=metrics)
    for i in range(100):
        recorder.record(rec(i))
    assert recorder.backlog == 100  # nothing written yet: the writer has not run
    assert await recorder.flush(5.0) == 0
    recorder.record(rec(100))
    await recorder.close(1.0)
    assert redis_server.client().xlen(stream) == 100
    assert outcome(metrics, "dropped") == 1


async def test_flush_gives_up_after_grace(own_redis: RestartableRedis) -> None:
    """Redis down at shutdown: flush returns after its grace with the records it lost."""
    stream, metrics = stream_key(), Metrics()
    recorder = UsageRecorder.from_url(own_redis.url, stream, metrics=metrics, timeout_s=0.2)
    own_redis.stop()
    for i in range(5):
        recorder.record(rec(i))
    assert await recorder.close(0.5) == 5
    assert outcome(metrics, "dropped") == 5
    assert recorder.backlog == 0


# -- reading -------------------------------------------------------------------------------------


def seed_at(client: redis.Redis, stream: str, t0: int, n: int) -> None:
    """n records appended at t0, t0+1s, ... (explicit stream ids), and one foreign entry."""
    for i in range(n):
        fields: dict[EncodableT, EncodableT] = dict(rec(i).to_fields().items())
        client.xadd(stream, fields, id=f"{t0 + i * 1000}-0")
    foreign: dict[EncodableT, EncodableT] = {"hello": "world"}
    client.xadd(stream, foreign, id=f"{t0 + n * 1000}-0")


def test_read_range_since_inclusive_until_exclusive(redis_server: RedisServer) -> None:
    """[since, until) by stream id, across pages; entries that are not records are skipped."""
    client, stream, t0 = redis_server.client(), stream_key(), 1_700_000_000_000
    seed_at(client, stream, t0, 10)
    got = list(read_range(client, stream, t0 + 2000, t0 + 7000, page=2))
    assert [i for i, _ in got] == [f"{t0 + k * 1000}-0" for k in range(2, 7)]
    assert [r.request_id for _, r in got] == [f"req-{k}" for k in range(2, 7)]
    assert len(list(read_range(client, stream, None, None, page=3))) == 10
    assert list(read_range(client, stream, t0 + 5000, t0 + 5000)) == []


def test_export_command(redis_server: RedisServer, tmp_path: Path, capsys: Any) -> None:
    """``ai-quota usage export``: ISO times to a CSV file, unix seconds to JSONL on stdout."""
    client, stream, t0 = redis_server.client(), stream_key(), 1_700_000_000_000
    seed_at(client, stream, t0, 6)
    out = tmp_path / "usage.csv"
    common = ["--redis-url", redis_server.url, "--stream", stream]
    # t0 is 2023-11-14T22:13:20Z
    rc = main(
        [
            "usage",
            "export",
            *common,
            "--since",
            "2023-11-14T22:13:21Z",
            "--until",
            "2023-11-14T23:13:24+01:00",
            "--format",
            "csv",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [r["request_id"] for r in rows] == ["req-1", "req-2", "req-3"]
    assert rows[0]["id"] == f"{t0 + 1000}-0" and rows[0]["input_tokens"] == "11"
    capsys.readouterr()
    rc = main(["usage", "export", *common, "--since", str(t0 // 1000 + 4)])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["request_id"] for x in lines] == ["req-4", "req-5"]
    assert main(["usage", "export", *common, "--since", "last week"]) == 2


def test_consumer_group_delivers_each_record_once(redis_server: RedisServer) -> None:
    """Two consumers of one group reading at the same time share 60 records: each read by
    exactly one, all acknowledged."""
    client, stream = redis_server.client(), stream_key()
    seed_at(client, stream, 1_700_000_000_000, 60)
    seen: dict[str, list[str]] = {"c1": [], "c2": []}
    common: dict[str, Any] = {"count": 3, "block_ms": 100, "claim_idle_ms": 0}

    def run(name: str, **kw: Any) -> None:
        own = redis_server.client()  # a client per thread
        consume(own, stream, "billing", name, lambda _i, r: seen[name].append(r.request_id), **kw)
        own.close()

    run("c1", max_records=10, **common)
    assert len(seen["c1"]) == 10
    # Each consumer holds its first record until the other has one too: on a loaded machine
    # the first thread could otherwise read every record before the second one starts.
    both = threading.Barrier(2, timeout=20)

    def together(name: str) -> None:
        first = True

        def handle(_i: str, r: Any) -> None:
            nonlocal first
            seen[name].append(r.request_id)
            if first:
                first = False
                both.wait()

        own = redis_server.client()
        consume(own, stream, "billing", name, handle, **common, exit_when_idle=True)
        own.close()

    threads = [threading.Thread(target=together, args=(name,)) for name in ("c1", "c2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen["c2"], "the second consumer got nothing"
    assert not set(seen["c1"]) & set(seen["c2"])
    assert sorted(seen["c1"] + seen["c2"]) == sorted(f"req-{i}" for i in range(60))
    assert client.xpending(stream, "billing")["pending"] == 0


def test_unacknowledged_records_come_back(redis_server: RedisServer) -> None:
    """A reader that fails before acknowledging gets the record again on restart; records
    another consumer left unacknowledged are claimed once idle long enough."""
    client, stream = redis_server.client(), stream_key()
    seed_at(client, stream, 1_700_000_000_000, 6)
    got: list[str] = []

    def failing(_id: str, r: UsageRecord) -> None:
        if r.request_id == "req-2":
            raise RuntimeError("warehouse down")
        got.append(r.request_id)

    common: dict[str, Any] = {"count": 3, "block_ms": 50, "claim_idle_ms": 0}
    with pytest.raises(RuntimeError):
        consume(client, stream, "g", "c1", failing, **common)
    assert got == ["req-0", "req-1"]
    # c1 restarts: its unacknowledged record comes first
    again: list[str] = []
    consume(client, stream, "g", "c1", lambda _i, r: again.append(r.request_id), max_records=1)
    assert again == ["req-2"]
    # c1 takes three more and dies before acknowledging one of them
    with pytest.raises(RuntimeError):
        consume(client, stream, "g", "c1", _fail_on("req-4"), **common)
    time.sleep(0.05)
    claimed: list[str] = []
    consume(
        client,
        stream,
        "g",
        "c2",
        lambda _i, r: claimed.append(r.request_id),
        count=10,
        block_ms=50,
        claim_idle_ms=20,
        exit_when_idle=True,
    )
    assert claimed == ["req-4", "req-5"]
    assert client.xpending(stream, "g")["pending"] == 0


def _fail_on(request_id: str) -> Callable[[str, UsageRecord], None]:
    def handle(_id: str, r: UsageRecord) -> None:
        if r.request_id == request_id:
            raise RuntimeError("crash")

    return handle


def test_consume_command(redis_server: RedisServer, capsys: Any) -> None:
    """``ai-quota usage consume`` prints one JSON line per record and acknowledges it."""
    client, stream = redis_server.client(), stream_key()
    seed_at(client, stream, 1_700_000_000_000, 3)
    args = ["usage", "consume", "--redis-url", redis_server.url, "--stream", stream]
    rc = main(
        [*args, "--group", "billing", "--consumer", "c1", "--block-ms", "50", "--exit-when-idle"]
    )
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["request_id"] for x in lines] == ["req-0", "req-1", "req-2"]
    assert lines[0]["id"] == "1700000000000-0"
    assert client.xpending(stream, "billing")["pending"] == 0


def test_batches_acknowledged_only_after_the_insert(redis_server: RedisServer) -> None:
    """A batch whose insert fails is acknowledged not at all and comes back whole; one that
    succeeds is acknowledged in full."""
    client, stream = redis_server.client(), stream_key()
    seed_at(client, stream, 1_700_000_000_000, 5)
    calls: list[list[str]] = []

    def insert(batch: list[tuple[str, UsageRecord]]) -> None:
        calls.append([r.request_id for _, r in batch])
        if len(calls) == 1:
            raise ConnectionError("warehouse down")

    with pytest.raises(ConnectionError):
        consume_batches(client, stream, "wh", "w1", insert, count=10, block_ms=50)
    assert client.xpending(stream, "wh")["pending"] == 6  # 5 records and the foreign entry
    n = consume_batches(client, stream, "wh", "w1", insert, block_ms=50, exit_when_idle=True)
    assert n == 5
    assert calls == [[f"req-{i}" for i in range(5)]] * 2
    assert client.xpending(stream, "wh")["pending"] == 0
