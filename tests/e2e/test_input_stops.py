"""An upstream that under-reports the prompt (issue 33), through the real stack: two Envoys,
two processor replicas, one Redis, the simulator reporting 4 % of the true prompt
(``x-sim-prompt-usage: scale:0.04``) once the input shortcut has been earned.

The bound (docs/semantics.md): with R replicas and ``requests.input_audit_every`` = E, at most
K = R x (E - 1) requests of a model are billed at such a figure across the fleet (here 2 x 15 =
30) before every replica counts that model's prompts; after a restart none.  Ground truth is
the simulator's own record of each request's prompt (``/sim/requests``), joined by request id
with the usage record each request was billed by."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from extproc.records.model import UsageRecord
from extproc.stack import Stack
from tests.e2e.conftest import client, make_stack
from tests.helpers import e2e_rules

pytestmark = pytest.mark.e2e

EVERY = 16
REPLICAS = 2
K = REPLICAS * (EVERY - 1)
#: 607 tokens; 4 % of it (24) is above the fewest tokens its byte bound allows (17), so the
#: lie is inside the range the shortcut would bill without a count
TEXT = "Tell me a long story. " * 100
LIE = {"x-sim-prompt-usage": "scale:0.04"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    rules = e2e_rules(requests={"admit_on_bound": True, "input_audit_every": EVERY})
    s = make_stack(
        Path(tmp_path_factory.mktemp("input-stops")),
        envoys=2,
        extprocs=REPLICAS,
        rules=rules,
    )
    yield s
    s.stop()


def send(stack: Stack, n: int, *, lie: bool, start: int = 0, streams: bool = True) -> None:
    """``n`` chat requests of tenant t-bound (one in three a stream unless ``streams`` is
    False), alternating between the two Envoys (and so, as Envoy balances ext_proc streams,
    between the replicas)."""
    for i in range(n):
        c = client(stack, "sk-bound", envoy=(start + i) % 2)
        messages: Any = [{"role": "user", "content": TEXT}]
        headers = LIE if lie else None
        if streams and (start + i) % 3 == 2:  # every third a stream, usage in its last chunk
            chunks = c.chat.completions.create(
                model="sim-small",
                messages=messages,
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers=headers,
            )
            assert [ch for ch in chunks if ch.usage is not None]
        else:
            c.chat.completions.create(
                model="sim-small", messages=messages, max_tokens=5, extra_headers=headers
            )


def billed(stack: Stack, rds: redis.Redis, want: int) -> list[tuple[UsageRecord, int, int]]:
    """(record, true prompt, reported prompt) of every request of t-bound, once ``want`` of
    them have their usage record."""
    deadline = time.monotonic() + 20
    while True:
        recs = [UsageRecord.from_fields(f or {}) for _, f in rds.xrange("aiq:usage") or []]
        recs = [r for r in recs if r.tenant == "t-bound"]
        if len(recs) >= want or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    sims = httpx.get(f"{stack.sim_url}/sim/requests").json()["requests"]
    truth = {r["request_id"]: (r["prompt_tokens"], r["prompt_tokens_reported"]) for r in sims}
    assert len(recs) == want
    return [(r, *truth[r.request_id]) for r in recs]


def low(rows: list[tuple[UsageRecord, int, int]]) -> list[UsageRecord]:
    """Records billed below what the counted path bills for the true prompt (its lowest trusted
    figure, 75 % - 16): billed at the lying figure."""
    return [r for r, true, _ in rows if r.input_tokens < true * 0.75 - 16]


def log_events(stack: Stack, name: str, event: str, since: int = 0) -> list[dict[str, object]]:
    """The JSON log lines ``event`` of part ``name`` written after byte ``since``."""
    path = stack.proc(name).log_path
    assert path is not None
    out = []
    for line in path.read_bytes()[since:].splitlines():
        if line.startswith(b"{"):
            ev = orjson.loads(line)
            if ev.get("event") == event:
                out.append(ev)
    return out


def test_a_lying_upstream_gets_at_most_k_low_bills_fleet_wide_then_none(fleet: Stack) -> None:
    """Honest first (both replicas earn the shortcut: their first requests are counted and
    agree), then 4 % from one request on: at most K billed low across both replicas, the stop
    is in Redis and in the finder's log with what it revealed; a second later every replica
    counts (no low bill), and a restarted replica bills none either (it reads the stop with its
    first requests, which its probation counts)."""
    rds = redis.Redis(port=fleet.ports.redis)
    send(fleet, 6, lie=False)
    honest = billed(fleet, rds, 6)
    assert not low(honest)
    assert any(r.input_check == "uncounted" for r, _, _ in honest)  # the shortcut runs

    # non-streams only: a stream is often counted anyway (observed: an audit of its own),
    # so this is the worst case for the bound
    send(fleet, 80, lie=True, start=6, streams=False)
    rows = billed(fleet, rds, 86)[6:]
    lows = low(rows)
    print(f"billed low: {len(lows)} of {len(rows)} (K = {K})")
    assert 1 <= len(lows) <= K
    assert {r.input_check for r in lows} == {"uncounted"}
    assert all(r.input_reported is not None and r.input_reported < 30 for r in lows)
    # the last low bill came before the last requests: the fleet stopped on its own
    assert not low(rows[-20:])
    # every replica stopped it: by its own count, or by reading the other's stop
    for i in range(REPLICAS):
        name = f"extproc{i}"
        found = log_events(fleet, name, "input_shortcut_stopped")
        adopted = log_events(fleet, name, "input_shortcut_stopped_elsewhere")
        assert found or adopted, name
    stops = list(rds.scan_iter("aiq:{input-stops}:*"))
    assert len(stops) == 1
    entry = orjson.loads(rds.hget(stops[0], "sim-small") or b"{}")
    assert entry["disagreement"] == "low" and entry["reported"] < entry["counted"] * 0.1
    finder = [
        e
        for i in range(REPLICAS)
        for e in log_events(fleet, f"extproc{i}", "input_shortcut_stopped")
    ]
    assert finder and all(int(str(e["gap"])) > 500 for e in finder)

    time.sleep(1.5)  # one refresh period (1 s) and more: both replicas hold the stop
    send(fleet, 20, lie=True, start=86)
    after = billed(fleet, rds, 106)[86:]
    assert not low(after)
    # each counted, its figure flagged in its record as the disagreement it is
    assert {r.input_check for r, _, _ in after} == {"low"}
    assert all(r.input_reported == reported for r, _, reported in after)

    fleet.kill("extproc1")  # SIGTERM: a restart forgets everything in memory
    log_path = fleet.proc("extproc1").log_path
    assert log_path is not None
    since = log_path.stat().st_size
    fleet.restart("extproc1")
    fleet.wait_extprocs_healthy()
    send(fleet, 20, lie=True, start=106)
    again = billed(fleet, rds, 126)[106:]
    assert not low(again) and {r.input_check for r, _, _ in again} == {"low"}
    # the restarted replica read the stop with its first request on a bound (its first
    # requests were counted meanwhile, its probation); it made no Redis call while idle
    events = [
        e["event"]
        for e in log_events(fleet, "extproc1", "input_shortcut_stopped_elsewhere", since)
        + log_events(fleet, "extproc1", "input_shortcut_stopped", since)
    ]
    assert events, "the restarted replica served nothing, or never learned of the stop"
