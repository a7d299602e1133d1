"""Two processor replicas behind one Envoy under steady streaming and non-streaming load: a
replica drained with SIGTERM, or killed with SIGKILL, then restarted.

A drain must fail no request.  A SIGKILL can only fail requests whose ext_proc stream was on the
killed replica at that moment (Envoy cannot move a stream the processor already answered); every
request that starts once the killed process is gone must succeed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.bench.rolling import rolling_restart
from extproc.settings import Settings
from extproc.stack import Stack
from tests.e2e.conftest import make_stack

pytestmark = pytest.mark.faults

KEY = "sk-drain"  # tenant t-drain, plan "big": limits far away


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = make_stack(Path(tmp_path_factory.mktemp("replicas")), extprocs=2)
    yield s
    s.stop()


async def test_drain_and_restart_of_one_replica_fails_nothing(two: Stack) -> None:
    """SIGTERM of one of two replicas under 30 concurrent clients, gone 1 s, restarted: 0
    failed requests in every phase, and the drain ended on its own (no kill needed)."""
    res = await rolling_restart(two, key=KEY, replica="extproc1", how="term", concurrency=30)
    summary = res.summary()
    print(summary)
    assert len(res.outcomes) > 100, summary
    assert res.failed == [], summary
    assert two.proc("extproc1").popen.poll() is None  # the restarted replica runs
    by = summary["by_phase"]
    assert isinstance(by, dict)
    assert all(by[p]["requests"] > 0 for p in ("fault", "gone", "back")), summary
    # the replica served on through its drain notice (the stack keeps the default) before exiting
    notice = Settings.model_fields["drain_notice_s"].default
    assert isinstance(summary["drain_s"], float) and summary["drain_s"] >= notice, summary


async def test_sigkill_fails_at_most_the_streams_on_the_killed_replica(two: Stack) -> None:
    """SIGKILL of one replica: only requests in flight on it fail (those in flight at the
    signal, or started in the few ms the process took to die); every request started once it
    was gone succeeds, while it is down and after its restart."""
    res = await rolling_restart(two, key=KEY, replica="extproc0", how="kill", concurrency=30)
    summary = res.summary()
    print(summary)
    assert len(res.outcomes) > 100, summary
    after = [o for o in res.failed if o.started >= res.gone_at]
    assert after == [], summary
    dying = [o for o in res.outcomes if res.fault_at <= o.started < res.gone_at]
    assert len(res.failed) <= res.in_flight_at_fault + len(dying), summary
