"""Usage records without Redis: the stream-entry round trip, JSONL/CSV rendering, time parsing,
the marker keys' hash slot and the ``ai-quota usage`` command line."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from redis.crc import key_slot

from extproc.cli import build_parser
from extproc.records.export import entry_time_ms, parse_time, render
from extproc.records.model import FIELDS, RecordFormatError, UsageRecord
from extproc.records.writer import marker_prefix
from extproc.usage.records_cli import run_consume, run_export

pytestmark = pytest.mark.unit


def sample(**over: object) -> UsageRecord:
    values: dict[str, object] = {
        "record_id": "r1",
        "request_id": "req-1",
        "tenant": "acme",
        "key": "ci",
        "model": "sim-small",
        "api": "chat",
        "input_tokens": 120,
        "cached_input_tokens": 64,
        "output_tokens": 300,
        "reasoning_tokens": 40,
        "ending": "completed",
        "status": 200,
        "admitted_at_ms": 1_717_171_717_000,
        "finished_at_ms": 1_717_171_718_500,
    }
    values.update(over)
    return UsageRecord(**values)  # type: ignore[arg-type]


def test_fields_round_trip_as_redis_returns_them() -> None:
    """A record read back from bytes fields (what redis-py returns) equals the one written."""
    rec = sample(cost=Decimal("0.001234"))
    raw = {k.encode(): v.encode() for k, v in rec.to_fields().items()}
    assert UsageRecord.from_fields(raw) == rec


def test_none_status_and_cost_round_trip() -> None:
    """No status (ended before a response) and no price survive as None, not 0."""
    rec = sample(status=None, cost=None, ending="client_disconnected")
    fields = rec.to_fields()
    assert fields["status"] == "" and fields["cost"] == ""
    back = UsageRecord.from_fields(fields)
    assert back.status is None and back.cost is None and back == rec


def test_fields_are_flat_strings_with_a_version() -> None:
    """Every stream field is a string and the entry names its schema version."""
    fields = sample().to_fields()
    assert fields["v"] == "1"
    assert all(isinstance(v, str) for v in fields.values())
    assert set(fields) == {"v", *FIELDS}


def test_unknown_fields_ignored_missing_optional_defaulted() -> None:
    """An entry from a newer writer (extra fields) or an older one (fewer) still reads."""
    fields = sample().to_fields()
    fields["price_tier"] = "gold"
    del fields["reasoning_tokens"], fields["cached_input_tokens"]
    back = UsageRecord.from_fields(fields)
    assert back.reasoning_tokens == 0 and back.cached_input_tokens == 0
    assert back.input_tokens == 120


def test_not_a_record() -> None:
    """An entry without a request id or with a non-numeric count is refused."""
    with pytest.raises(RecordFormatError):
        UsageRecord.from_fields({"tenant": "acme"})
    with pytest.raises(RecordFormatError):
        UsageRecord.from_fields({**sample().to_fields(), "input_tokens": "many"})


def test_jsonl_rendering() -> None:
    """JSONL: one object per record, the entry id first, then the fields in order; the cost is
    a decimal string and a missing status is null."""
    text = render(
        [
            ("1717171718500-0", sample(cost=Decimal("0.5"))),
            ("1717171718501-0", sample(status=None)),
        ],
        "jsonl",
    )
    lines = text.splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert list(first) == ["id", *FIELDS]
    assert first["id"] == "1717171718500-0"
    assert first["cost"] == "0.5" and first["input_tokens"] == 120
    assert second["status"] is None and second["cost"] is None


def test_csv_rendering() -> None:
    """CSV: a header (id + fields) then one row per record; None is an empty cell."""
    text = render([("5-0", sample(status=None, tenant='a,"b"'))], "csv")
    rows = list(csv.reader(io.StringIO(text)))
    assert rows[0] == ["id", *FIELDS]
    row = dict(zip(rows[0], rows[1], strict=True))
    assert row["id"] == "5-0" and row["tenant"] == 'a,"b"'
    assert row["status"] == "" and row["output_tokens"] == "300"
    assert render([], "csv").splitlines() == [",".join(["id", *FIELDS])]
    assert render([], "jsonl") == ""
    with pytest.raises(ValueError, match="format"):
        render([], "xml")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1717171717", 1_717_171_717_000),
        ("1717171717.25", 1_717_171_717_250),
        ("2024-05-31T16:08:37Z", 1_717_171_717_000),
        ("2024-05-31T18:08:37+02:00", 1_717_171_717_000),
        ("2024-05-31T16:08:37", 1_717_171_717_000),  # no offset: UTC
        ("2024-05-31T16:08:37.5Z", 1_717_171_717_500),
        ("2024-05-31", int(datetime(2024, 5, 31, tzinfo=UTC).timestamp() * 1000)),
    ],
)
def test_parse_time(text: str, expected: int) -> None:
    """--since/--until accept unix seconds and ISO 8601 (UTC unless an offset is given)."""
    assert parse_time(text) == expected


@pytest.mark.parametrize("text", ["yesterday", "", "2024-13-01", "-5"])
def test_parse_time_rejects(text: str) -> None:
    """Anything else is an error naming the accepted forms."""
    with pytest.raises(ValueError, match="ISO 8601"):
        parse_time(text)


def test_entry_time() -> None:
    """A stream id's first part is the append time in unix milliseconds."""
    assert entry_time_ms("1717171717000-3") == 1_717_171_717_000


@pytest.mark.parametrize("stream", ["aiq:usage", "billing:usage:eu", "aiq:{usage}", "a{b"])
def test_markers_share_the_stream_slot(stream: str) -> None:
    """On Redis Cluster the per-record markers hash to the stream's slot (one script call)."""
    marker = marker_prefix(stream) + "0123abcd"
    assert key_slot(marker.encode()) == key_slot(stream.encode())


@pytest.mark.parametrize("stream", ["x{}y", "{}{x}", "a}b"])
def test_stream_key_without_a_usable_slot_prefix(stream: str) -> None:
    """A stream key whose braces hold no tag cannot share its slot: refused up front."""
    with pytest.raises(ValueError, match="hash tag"):
        marker_prefix(stream)


def test_usage_cli_without_subcommand_is_unchanged() -> None:
    """``ai-quota usage --key K`` parses as before; neither --key nor --tenant is an error."""
    p = build_parser()
    args = p.parse_args(["usage", "--key", "sk-x", "--json"])
    assert args.key == "sk-x" and args.json and getattr(args, "usage_run", None) is None
    args = p.parse_args(["usage", "--tenant", "acme", "--model", "m"])
    assert args.tenant == "acme" and args.model == "m"
    with pytest.raises(SystemExit) as exc:
        p.parse_args(["usage", "--key", "a", "--tenant", "b"])
    assert exc.value.code == 2
    args = p.parse_args(["usage"])
    with pytest.raises(SystemExit) as exc:
        args.func(args)
    assert exc.value.code == 2


def test_usage_cli_subcommands() -> None:
    """``usage export`` and ``usage consume`` parse into their own runners."""
    p = build_parser()
    args = p.parse_args(
        ["usage", "export", "--since", "2024-05-31", "--until", "1717171717", "--format", "csv"]
    )
    assert args.usage_run is run_export
    assert (args.since, args.until, args.format, args.out) == (
        "2024-05-31",
        "1717171717",
        "csv",
        None,
    )
    args = p.parse_args(["usage", "consume", "--group", "billing", "--consumer", "c1"])
    assert args.usage_run is run_consume
    assert (args.group, args.consumer, args.claim_idle_ms) == ("billing", "c1", 60_000)
    with pytest.raises(SystemExit):
        p.parse_args(["usage", "consume", "--group", "billing"])  # --consumer is required
