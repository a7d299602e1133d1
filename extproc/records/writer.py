"""The usage recorder: settlement hands it a record and moves on; a background task appends
records to a Redis Stream in batches.

* ``record()`` never blocks and never raises: it queues the record and wakes the writer.
* The writer takes up to ``batch_size`` queued records and writes them in **one** script call
  (``XADD ... MAXLEN ~ N`` per record, so the stream stays bounded).  Each record carries a
  ``record_id``; the script sets a short-lived marker per record id holding the ending
  written, and skips a record whose marker holds its ending, so a batch sent again after an
  ambiguous failure (a timeout after Redis had applied it) is not written twice.  (A
  request's records share their id: a reclaimed request that its live processor settles
  later has two, and both are written; a reclaim's record for a request whose own record was
  written already, within the marker's time, is skipped.)  The markers share the stream's
  hash slot.
* When Redis fails, the batch goes back to the head of the queue and is retried with backoff
  (0.2 s doubling to 5 s), like a kept settlement.  The queue is bounded (``max_kept``): beyond
  it the oldest record is dropped, counted and logged.
* ``flush(grace_s)`` on shutdown writes what is still queued, for at most ``grace_s``.

Metrics: ``aiq_usage_records{outcome}`` (``written`` at the first attempt, ``retried`` written
after a failed attempt, ``dropped``) and ``aiq_usage_record_backlog`` (records in memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import redis.exceptions
import structlog

from extproc.limiter.packing import use_hiredis_packing
from extproc.limiter.redis_url import async_client
from extproc.records.model import UsageRecord

if TYPE_CHECKING:
    from extproc.metrics import Metrics
    from extproc.settings import Settings

log = structlog.get_logger("extproc")

DEFAULT_MAXLEN = 1_000_000
DEFAULT_MAX_KEPT = 100_000
DEFAULT_BATCH = 256
#: How long the writer waits after the first queued record for others to share its write
#: (records reach Redis at most this much later; a flush on shutdown does not wait).
DEFAULT_LINGER_S = 0.05

#: How long a record's marker stays: a batch retried within this long is never written twice.
DEFAULT_MARKER_TTL_S = 900
BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 5.0

_ERRORS = (
    redis.exceptions.RedisError,
    ConnectionError,
    OSError,
    TimeoutError,
    asyncio.TimeoutError,
)

# KEYS[1] the stream, KEYS[1+i] the marker of record i (one per record id; it holds the
# ending written).
# ARGV[1] MAXLEN (approximate), ARGV[2] marker TTL (ms), then per record: its ending, the
# number of field/value strings that follow, and those strings.
# A record is skipped when its marker holds its own ending (the same record sent again), or
# when it is a reclaim's ("reclaimed") and the marker holds another ending (the request's
# own record was written: its processor settled it before it died, or was alive after all);
# a request's own record after a reclaim's is written (it replaces it downstream).
# Returns one entry per record: its stream id, or "" when its marker said to skip it.
_APPEND_LUA = """
local pos = 3
local out = {}
for i = 2, #KEYS do
  local ending = ARGV[pos]
  local n = tonumber(ARGV[pos + 1])
  pos = pos + 2
  local had = redis.call('GET', KEYS[i])
  if not had or (had ~= ending and ending ~= 'reclaimed') then
    redis.call('SET', KEYS[i], ending, 'PX', ARGV[2])
    local cmd = {'XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*'}
    for j = pos, pos + n - 1 do
      cmd[#cmd + 1] = ARGV[j]
    end
    out[#out + 1] = redis.call(unpack(cmd))
  else
    out[#out + 1] = ''
  end
  pos = pos + n
end
return out
"""


def marker_prefix(stream: str) -> str:
    """The prefix of the per-record markers, in the stream's hash slot on Redis Cluster.

    A key without a hash tag hashes as a whole, so ``{aiq:usage}:rec:...`` lands in the slot of
    ``aiq:usage``; a stream key that has a tag (``aiq:{usage}``) lends it to its markers.  A
    key with a ``}`` but no tag (``a{}b``) has no such prefix: ValueError."""
    start = stream.find("{")
    if start >= 0:
        end = stream.find("}", start + 1)
        if end > start + 1:
            return f"{stream}:rec:"
    if "}" in stream:
        raise ValueError(f"usage stream key {stream!r}: a '}}' without a hash tag before it")
    return f"{{{stream}}}:rec:"


def redis_client(url: str, *, timeout_s: float = 1.0, max_connections: int = 4) -> Any:
    """An asyncio client for any Redis URL the limiter takes (its own small pool; see
    :mod:`extproc.limiter.redis_url`), packing commands with hiredis as the limiter's do: a
    batch of records is a thousand arguments, each an ``Encoder.encode`` call in redis-py's
    own packer (about 40 µs of CPU per record; a few with hiredis)."""
    client = async_client(url, timeout_s=timeout_s, max_connections=max_connections)
    use_hiredis_packing(client)
    return client


@dataclass(slots=True)
class _Queued:
    rec: UsageRecord
    failed: bool = False


class UsageRecorder:
    """Appends usage records to a Redis Stream without ever blocking the caller."""

    def __init__(
        self,
        client: Any,
        stream: str,
        *,
        maxlen: int = DEFAULT_MAXLEN,
        metrics: Metrics | None = None,
        max_kept: int = DEFAULT_MAX_KEPT,
        batch_size: int = DEFAULT_BATCH,
        timeout_s: float = 1.0,
        marker_ttl_s: int = DEFAULT_MARKER_TTL_S,
        linger_s: float = DEFAULT_LINGER_S,
    ) -> None:
        if not stream:
            raise ValueError("the usage stream key is empty")
        self.client = client
        self.stream = stream
        self.maxlen = maxlen
        self.metrics = metrics
        self.max_kept = max_kept
        self.batch_size = batch_size
        self.timeout_s = timeout_s
        self.marker_ttl_ms = marker_ttl_s * 1000
        self.linger_s = linger_s
        self.dropped = 0
        self.written = 0
        self._markers = marker_prefix(stream)
        self._script = client.register_script(_APPEND_LUA)
        self._queue: deque[_Queued] = deque()
        self._inflight: list[_Queued] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @classmethod
    def from_url(cls, url: str, stream: str, **kwargs: Any) -> UsageRecorder:
        """A recorder with its own connection pool to ``url``."""
        timeout_s = float(kwargs.get("timeout_s", 1.0))
        return cls(redis_client(url, timeout_s=timeout_s), stream, **kwargs)

    # -- the caller's side -------------------------------------------------------------------

    @property
    def backlog(self) -> int:
        """Records in memory, not yet in Redis."""
        return len(self._queue) + len(self._inflight)

    def record(self, rec: UsageRecord) -> None:
        """Queue ``rec`` for writing; returns at once (call it from the event loop)."""
        if not rec.record_id:
            rec = replace(rec, record_id=uuid.uuid4().hex)
        if self._closed:
            self._drop(rec, "recorder_closed")
            return
        while self.backlog >= self.max_kept and self._queue:
            self._drop(self._queue.popleft().rec, "backlog_full")
        self._queue.append(_Queued(rec))
        self._export_backlog()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    # -- the writer --------------------------------------------------------------------------

    async def _run(self) -> None:
        delay = BACKOFF_MIN_S
        while not self._closed:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                if self.linger_s > 0 and len(self._queue) < self.batch_size:
                    # let a batch gather: one script call for many records, not one each
                    await asyncio.sleep(self.linger_s)
                continue
            if await self._write_batch():
                delay = BACKOFF_MIN_S
            else:
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)

    async def _write_batch(self) -> bool:
        """Write the oldest queued records; on failure they go back to the head of the queue."""
        n = min(self.batch_size, len(self._queue))
        self._inflight = [self._queue.popleft() for _ in range(n)]
        keys: list[str] = [self.stream]
        args: list[Any] = [self.maxlen, self.marker_ttl_ms]
        for q in self._inflight:
            keys.append(f"{self._markers}{q.rec.record_id}")
            fields = q.rec.to_fields()
            args += [q.rec.ending, 2 * len(fields)]
            for name, value in fields.items():
                args += [name, value]
        ok = False
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._script(keys=keys, args=args)
            ok = True
        except _ERRORS as exc:
            log.warning(
                "usage_records_write_failed",
                error=type(exc).__name__,
                batch=len(self._inflight),
                backlog=self.backlog,
            )
        finally:
            batch, self._inflight = self._inflight, []
            if ok:
                self._count_written(batch)
            else:  # a failure or a cancellation: keep them, oldest first
                for q in reversed(batch):
                    q.failed = True
                    self._queue.appendleft(q)
            self._export_backlog()
        return ok

    def _count_written(self, batch: list[_Queued]) -> None:
        self.written += len(batch)
        if self.metrics is None:
            return
        late = sum(1 for q in batch if q.failed)
        if late:
            self.metrics.usage_records.labels("retried").inc(late)
        if len(batch) > late:
            self.metrics.usage_records.labels("written").inc(len(batch) - late)

    def _drop(self, rec: UsageRecord, reason: str) -> None:
        self.dropped += 1
        if self.metrics is not None:
            self.metrics.usage_records.labels("dropped").inc()
        log.error(
            "usage_record_dropped",
            reason=reason,
            record_id=rec.record_id,
            request_id=rec.request_id,
            tenant=rec.tenant,
        )

    def _export_backlog(self) -> None:
        if self.metrics is not None:
            self.metrics.usage_record_backlog.set(self.backlog)

    # -- shutdown ----------------------------------------------------------------------------

    async def flush(self, grace_s: float) -> int:
        """Stop the background writer and write what is queued, for at most ``grace_s``
        seconds; records still unwritten then are dropped (logged, counted).  Later
        ``record()`` calls are dropped too.  Returns how many were lost."""
        self._closed = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, grace_s)
        while self._queue and loop.time() < deadline:
            if not await self._write_batch():
                await asyncio.sleep(min(BACKOFF_MIN_S, max(0.0, deadline - loop.time())))
        lost = len(self._queue)
        if lost:
            log.error("usage_records_lost_on_shutdown", count=lost)
            while self._queue:
                self._drop(self._queue.popleft().rec, "shutdown")
            self._export_backlog()
        return lost

    async def close(self, grace_s: float = 5.0) -> int:
        """``flush`` then close the connection pool."""
        lost = await self.flush(grace_s)
        with contextlib.suppress(*_ERRORS):
            await self.client.aclose()
        return lost


def make_recorder(settings: Settings, metrics: Metrics | None = None) -> UsageRecorder | None:
    """The process's recorder from ``AIQ_USAGE_STREAM`` / ``AIQ_USAGE_STREAM_MAXLEN`` and
    ``AIQ_REDIS_URL``; None when the stream is disabled (an empty stream name)."""
    if not settings.usage_stream:
        return None
    return UsageRecorder.from_url(
        settings.redis_url,
        settings.usage_stream,
        maxlen=settings.usage_stream_maxlen,
        metrics=metrics,
    )
