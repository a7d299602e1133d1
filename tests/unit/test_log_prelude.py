"""The log lines' one-processor prelude (issue 27) writes what structlog's four processors
wrote: bound context values, the level, an ISO UTC timestamp, a rendered exception."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import structlog
from structlog import processors

from extproc.logs import Prelude, UtcIsoStamper

pytestmark = pytest.mark.unit

ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{6})?Z$")


@pytest.fixture(autouse=True)
def _clean_context() -> Iterator[None]:
    structlog.contextvars.clear_contextvars()
    yield
    structlog.contextvars.clear_contextvars()


def _standard(method: str, event: dict[str, Any]) -> dict[str, Any]:
    out: Any = dict(event)
    for proc in (
        structlog.contextvars.merge_contextvars,
        processors.add_log_level,
        processors.TimeStamper(fmt="iso", utc=True),
        processors.format_exc_info,
    ):
        out = proc(None, method, out)
    return dict(out)


def _same_but_time(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert ISO.match(got.pop("timestamp"))
    assert ISO.match(want.pop("timestamp"))
    assert got == want


@pytest.mark.parametrize("method", ["info", "warning", "warn", "error", "exception", "debug"])
def test_same_event_dict_as_the_four_processors(method: str) -> None:
    structlog.contextvars.bind_contextvars(request_id="r-1", tenant="t-1")
    structlog.contextvars.bind_contextvars(model="m")
    structlog.contextvars.clear_contextvars()  # cleared values (Ellipsis) are left out
    structlog.contextvars.bind_contextvars(request_id="r-2")
    event = {"event": "settled", "tenant": "explicit", "input_tokens": 7}
    got = Prelude()(None, method, dict(event))
    _same_but_time(got, _standard(method, event))
    assert got["request_id"] == "r-2" and got["tenant"] == "explicit" and "model" not in got


def test_exception_rendered_as_before() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        got = Prelude()(None, "exception", {"event": "stream_failed", "exc_info": True})
        want = _standard("exception", {"event": "stream_failed", "exc_info": True})
    assert "ValueError: boom" in got["exception"] and "exc_info" not in got
    _same_but_time(got, want)


def test_timestamp_is_now_in_utc() -> None:
    before = datetime.now(UTC)
    stamp = UtcIsoStamper()(None, "info", {})["timestamp"]
    first = UtcIsoStamper()(None, "info", {})["timestamp"]
    after = datetime.now(UTC)
    for s in (stamp, first):
        assert ISO.match(s)
        t = datetime.fromisoformat(s.replace("Z", "+00:00"))
        assert before.replace(microsecond=0) <= t <= after
