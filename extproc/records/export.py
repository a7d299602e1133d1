"""Reading usage records back from the Redis Stream: a time range rendered as JSONL or CSV
(:func:`export`) and a consumer-group reader that acknowledges a record only after the caller
handled it (:func:`consume_batches`).  Synchronous: what runs these is a command-line tool
(``ai-quota usage export`` / ``consume``, :mod:`extproc.usage.records_cli`), not the request path.

Stream entry ids start with the unix time in milliseconds at which Redis appended the record,
so a time range is an ``XRANGE`` between two ids: ``--since`` inclusive, ``--until`` exclusive.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import IO, Any

import orjson
import redis
import redis.cluster
import redis.exceptions

from extproc.limiter import redis_url
from extproc.records.model import FIELDS, RecordFormatError, UsageRecord

#: Stream entries read per XRANGE / XREADGROUP call.
PAGE = 1000
_NUMBER = re.compile(r"^\d+(\.\d+)?$")


def parse_time(text: str) -> int:
    """Unix milliseconds from unix seconds (``1717171717``, ``1717171717.5``) or ISO 8601
    (``2024-05-31``, ``2024-05-31T16:08:37Z``, ``...+02:00``; no offset means UTC)."""
    s = text.strip()
    if _NUMBER.match(s):
        return round(float(s) * 1000)
    try:
        when = datetime.fromisoformat(s)
    except ValueError as exc:
        raise ValueError(
            f"{text!r} is neither unix seconds nor an ISO 8601 time (2024-05-31T16:08:37Z)"
        ) from exc
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return round(when.timestamp() * 1000)


def entry_time_ms(entry_id: str) -> int:
    """The unix milliseconds at which Redis appended the entry (the id's first part)."""
    return int(entry_id.split("-", 1)[0])


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes | bytearray) else str(value)


def sync_client(url: str, *, timeout_s: float = 5.0) -> Any:
    """A blocking client for any Redis URL the limiter takes (:mod:`extproc.limiter.redis_url`)."""
    return redis_url.sync_client(url, timeout_s=timeout_s)


# -- export ------------------------------------------------------------------------------------


def read_range(
    client: Any, stream: str, since_ms: int | None, until_ms: int | None, *, page: int = PAGE
) -> Iterator[tuple[str, UsageRecord]]:
    """(entry id, record) for every record appended in ``[since_ms, until_ms)``, oldest first.
    Entries that are not usage records are skipped."""
    start = "-" if since_ms is None else f"{since_ms}-0"
    if until_ms is not None and until_ms <= (since_ms or 0):
        return
    end = "+" if until_ms is None else f"{until_ms - 1}"  # an id without a sequence: all of it
    while True:
        entries = client.xrange(stream, min=start, max=end, count=page)
        for raw_id, fields in entries:
            entry_id = _text(raw_id)
            try:
                yield entry_id, UsageRecord.from_fields(fields)
            except RecordFormatError:
                continue
        if len(entries) < page:
            return
        start = "(" + _text(entries[-1][0])


class Renderer:
    """Writes records as JSONL or CSV (each line carries the entry ``id`` first)."""

    def __init__(self, out: IO[str], fmt: str) -> None:
        if fmt not in ("jsonl", "csv"):
            raise ValueError(f"unknown format {fmt!r} (jsonl or csv)")
        self.out = out
        self.fmt = fmt
        self._csv = csv.writer(out, lineterminator="\n") if fmt == "csv" else None
        self._header = False

    def write(self, entry_id: str, rec: UsageRecord) -> None:
        """Write one record (the CSV header before the first)."""
        if self._csv is not None:
            if not self._header:
                self._csv.writerow(["id", *FIELDS])
                self._header = True
            self._csv.writerow([entry_id, *rec.to_row()])
        else:
            self.out.write(jsonl_line(entry_id, rec))

    def finish(self) -> None:
        """A CSV export with no records still gets its header."""
        if self._csv is not None and not self._header:
            self._csv.writerow(["id", *FIELDS])
            self._header = True


def jsonl_line(entry_id: str, rec: UsageRecord) -> str:
    """One record as a JSON line, its stream entry id first."""
    return orjson.dumps({"id": entry_id, **rec.to_json()}).decode() + "\n"


def render(records: list[tuple[str, UsageRecord]], fmt: str) -> str:
    """Records as JSONL or CSV text."""
    buf = io.StringIO()
    r = Renderer(buf, fmt)
    for entry_id, rec in records:
        r.write(entry_id, rec)
    r.finish()
    return buf.getvalue()


def export(
    client: Any,
    stream: str,
    out: IO[str],
    *,
    since_ms: int | None,
    until_ms: int | None,
    fmt: str = "jsonl",
) -> int:
    """Write the records of ``[since_ms, until_ms)`` to ``out``; how many."""
    r = Renderer(out, fmt)
    n = 0
    for entry_id, rec in read_range(client, stream, since_ms, until_ms):
        r.write(entry_id, rec)
        n += 1
    r.finish()
    out.flush()
    return n


# -- consumer group ----------------------------------------------------------------------------


def ensure_group(client: Any, stream: str, group: str, start: str = "0") -> bool:
    """Create ``group`` on ``stream`` (and the stream) unless it exists; whether it was made.
    ``start`` ``0`` reads every record still in the stream, ``$`` only new ones."""
    try:
        client.xgroup_create(stream, group, id=start, mkstream=True)
    except redis.exceptions.ResponseError as exc:
        if "BUSYGROUP" in str(exc):
            return False
        raise
    return True


Batch = list[tuple[str, UsageRecord]]


def consume(
    client: Any,
    stream: str,
    group: str,
    consumer: str,
    handle: Callable[[str, UsageRecord], None],
    *,
    count: int = 100,
    block_ms: int = 5000,
    claim_idle_ms: int = 60_000,
    max_records: int | None = None,
    exit_when_idle: bool = False,
) -> int:
    """Deliver records one by one to ``handle`` and acknowledge each as soon as ``handle``
    returned; how many were handled.

    At least once: the consumer's own unacknowledged records are delivered first (a restart
    after a crash between ``handle`` and ``XACK``), then those other consumers of the group left
    unacknowledged for ``claim_idle_ms`` (XAUTOCLAIM; 0 disables), then new records.  A record
    trimmed from the stream before it was read is gone: size ``MAXLEN`` for the longest pause a
    consumer may take.  Runs until ``max_records`` were handled, or (``exit_when_idle``) until a
    read waited ``block_ms`` for nothing.  Entries that are not usage records are acknowledged
    and skipped; an exception from ``handle`` propagates and leaves its record (and the rest of
    its read) unacknowledged."""

    def one_by_one(batch: Batch, ids: list[str]) -> int:
        done = 0
        handled = {entry_id for entry_id, _ in batch}
        records = dict(batch)
        for entry_id in ids:
            if entry_id in handled:
                handle(entry_id, records[entry_id])
                done += 1
            client.xack(stream, group, entry_id)
        return done

    return _read_group(
        client,
        stream,
        group,
        consumer,
        one_by_one,
        count=count,
        block_ms=block_ms,
        claim_idle_ms=claim_idle_ms,
        max_records=max_records,
        exit_when_idle=exit_when_idle,
    )


def consume_batches(
    client: Any,
    stream: str,
    group: str,
    consumer: str,
    handle_batch: Callable[[Batch], None],
    *,
    count: int = 1000,
    block_ms: int = 5000,
    claim_idle_ms: int = 60_000,
    max_records: int | None = None,
    exit_when_idle: bool = False,
) -> int:
    """Like :func:`consume`, a read at a time: ``handle_batch`` gets up to ``count`` records
    (an insert into a warehouse) and all of them are acknowledged, in one XACK, once it
    returned.  If it raises, none of them is, and they are delivered again."""

    def whole(batch: Batch, ids: list[str]) -> int:
        if batch:
            handle_batch(batch)
        if ids:
            client.xack(stream, group, *ids)
        return len(batch)

    return _read_group(
        client,
        stream,
        group,
        consumer,
        whole,
        count=count,
        block_ms=block_ms,
        claim_idle_ms=claim_idle_ms,
        max_records=max_records,
        exit_when_idle=exit_when_idle,
    )


def _read_group(
    client: Any,
    stream: str,
    group: str,
    consumer: str,
    deliver: Callable[[Batch, list[str]], int],
    *,
    count: int,
    block_ms: int,
    claim_idle_ms: int,
    max_records: int | None,
    exit_when_idle: bool,
) -> int:
    ensure_group(client, stream, group)
    done = 0

    def room() -> int:
        return count if max_records is None else min(count, max_records - done)

    def take(entries: list[Any]) -> None:
        nonlocal done
        batch: Batch = []
        ids: list[str] = []
        for raw_id, fields in entries:
            entry_id = _text(raw_id)
            ids.append(entry_id)
            if not fields:  # a pending entry trimmed away comes back without fields
                continue
            try:
                batch.append((entry_id, UsageRecord.from_fields(fields)))
            except RecordFormatError:
                continue
        done += deliver(batch, ids)

    # 1. what this consumer was given and never acknowledged
    last = "0"
    while room() > 0:
        resp = client.xreadgroup(group, consumer, {stream: last}, count=room())
        pending = resp[0][1] if resp else []
        if not pending:
            break
        take(pending)
        last = _text(pending[-1][0])
    # 2. then the others' stale deliveries, and new records
    while room() > 0:
        if claim_idle_ms > 0:
            claimed = client.xautoclaim(
                stream, group, consumer, min_idle_time=claim_idle_ms, start_id="0-0", count=room()
            )
            if claimed[1]:
                take(claimed[1])
                continue
        resp = client.xreadgroup(group, consumer, {stream: ">"}, count=room(), block=block_ms)
        fresh = resp[0][1] if resp else []
        if fresh:
            take(fresh)
        elif exit_when_idle:
            break
    return done
