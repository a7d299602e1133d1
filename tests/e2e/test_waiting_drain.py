"""Requests waiting for their turn when their processor drains (SIGTERM), end to end through a
real Envoy with config/examples/waiting.yaml (docs/operations.md "Draining and rolling
restarts", docs/semantics.md "Waiting"):

* a waiter whose turn comes within the drain's grace is served in its turn;
* a waiter whose turn comes after the grace's end is answered as soon as the drain starts: a
  429 with the ``retry-after`` of its turn and a message saying the replica is shutting down,
  not Envoy's error at the grace's end;
* its ticket leaves the tenant's queue, nothing reaches the upstream for it and nothing is
  counted for it (the upstream's own records and the Redis counters);
* the processor exits 0.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis
import yaml

from extproc.core.keys import tenant_tag
from extproc.core.waiting import queue_keys
from extproc.stack import Stack
from tests.e2e.conftest import make_stack
from tests.e2e.test_waiting import EXAMPLE, WINDOW, Answer, ask, sim_records, window_start

pytestmark = pytest.mark.e2e

NOTICE_S = 0.2
GRACE_S = 5.0


@pytest.fixture(scope="module")
def dstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = make_stack(
        Path(tmp_path_factory.mktemp("waiting-drain")),
        rules=yaml.safe_load(EXAMPLE.read_text()),
        extproc_env={"AIQ_DRAIN_NOTICE_S": str(NOTICE_S), "AIQ_SHUTDOWN_GRACE_S": str(GRACE_S)},
    )
    yield s
    s.stop()


def _ask_into(stack: Stack, out: list[Answer]) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(ask(stack, "sk-wait-a", 0, timeout=40.0)))
    t.start()
    return t


def _rpm_counts(rds: redis.Redis) -> dict[int, int]:
    """wait-a's RPM counters: requests counted per fixed window (by the window's index)."""
    counts: dict[int, int] = {}
    for key in rds.scan_iter(f"{tenant_tag('aiq', 'wait-a')}:rpm:*"):
        counts[int(key.rsplit(":", 1)[1])] = int(rds.get(key) or 0)
    return counts


def test_a_drain_serves_waiters_within_its_grace_and_refuses_the_rest_at_once(
    dstack: Stack,
) -> None:
    rds = redis.Redis(port=dstack.ports.redis, decode_responses=True)
    q = queue_keys(tenant_tag("aiq", "wait-a"), "wait-a")[0]
    assert ask(dstack, "sk-wait-b", 0).status == 200  # warm the replica (another tenant)
    w0 = window_start()
    before = len(sim_records(dstack, "wait-a"))
    # 4 at once: 2 served now, 2 waiting for the next window (w0 + 10 s)
    early: list[Answer] = []
    threads = [_ask_into(dstack, early) for _ in range(4)]
    time.sleep(w0 + 6.0 - time.time())
    # 2 more at w0 + 6: their turn is the window after (w0 + 20 s), 14 s away (the plan waits 15)
    late: list[Answer] = []
    threads += [_ask_into(dstack, late) for _ in range(2)]
    time.sleep(w0 + 7.0 - time.time())
    assert rds.zcard(q) == 4  # four tickets in the queue
    proc = dstack.proc("extproc0")
    sigterm = time.time()
    proc.popen.send_signal(signal.SIGTERM)
    # the drain starts after the notice and ends at the grace: w0 + 12.2, after the first
    # waiters' turn (w0 + 10), before the late ones' (w0 + 20)
    drain_end = sigterm + NOTICE_S + GRACE_S
    for t in threads:
        t.join(45)
        assert not t.is_alive()
    assert proc.popen.wait(20) == 0

    early.sort(key=lambda a: a.took)
    assert [a.status for a in early] == [200] * 4, early
    assert all(a.took < 2.0 for a in early[:2]), early
    for a in early[2:]:  # served in their turn, within the grace
        done = a.started + a.took
        assert w0 + WINDOW <= done < drain_end, (a, w0, drain_end)
        assert int(a.headers["x-ratelimit-waited-ms"]) > 8000, a

    assert [a.status for a in late] == [429, 429], late
    for a in late:
        done = a.started + a.took
        # answered when the drain started, not held until the grace's end
        assert done < sigterm + NOTICE_S + 2.0, (a, sigterm)
        # retry-after: its turn (the next window's start), from when it was answered
        turn = done + float(a.headers["retry-after-ms"]) / 1000
        assert w0 + 2 * WINDOW - 1.0 <= turn <= w0 + 2 * WINDOW + 1.0, (a, w0)
        assert int(a.headers["retry-after"]) >= 12, a
        assert int(a.headers["x-ratelimit-waited-ms"]) > 500, a
        err = orjson.loads(a.body)["error"]
        assert "shutting down" in err["message"], err

    # the tickets left the queue; the upstream served the 4 only; the counters hold the 4
    assert rds.zcard(q) == 0
    recs = sim_records(dstack, "wait-a")
    assert len(recs) - before == 4, recs
    counts = _rpm_counts(rds)
    w0_index = int(w0 // WINDOW)
    assert counts.get(w0_index) == 2 and counts.get(w0_index + 1) == 2, counts
    assert counts.get(w0_index + 2, 0) == 0, counts

    # what the processor said: two waits over, ended by the drain
    assert proc.log_path is not None
    lines = [orjson.loads(x) for x in proc.log_path.read_text().splitlines() if x.startswith("{")]
    over = [x for x in lines if x.get("event") == "wait_over"]
    assert sorted(x["outcome"] for x in over) == ["admitted", "admitted", "draining", "draining"]
