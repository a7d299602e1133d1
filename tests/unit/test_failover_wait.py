"""The bound on how long a call that finds Redis unavailable is sent again
(:func:`extproc.limiter.caller.failover_pause`, :func:`extproc.limiter.caller.may_wait`)."""

from __future__ import annotations

import pytest

from extproc.limiter.caller import failover_pause, may_wait
from extproc.settings import Settings

pytestmark = pytest.mark.unit


def test_pauses_start_short_and_stay_under_a_quarter_second() -> None:
    pauses = [failover_pause(n) for n in range(10)]
    assert pauses[:4] == [0.05, 0.1, 0.2, 0.25]
    assert max(pauses) == 0.25  # a promotion is seen within a quarter second of answering


def test_a_call_waits_only_while_its_pause_ends_within_the_bound() -> None:
    assert may_wait(0.0, 0.05, 8.0)
    assert may_wait(7.75, 0.25, 8.0)  # ends exactly at the bound
    assert not may_wait(7.8, 0.25, 8.0)  # would end past it: fail now, not later
    assert not may_wait(0.0, 0.05, 0.0)  # 0: fail at once (the previous behaviour)


def test_the_summed_pauses_never_exceed_the_bound() -> None:
    for bound in (0.3, 1.0, 2.5, 8.0):
        elapsed, n = 0.0, 0
        while may_wait(elapsed, failover_pause(n), bound):
            elapsed += failover_pause(n)
            n += 1
        assert elapsed <= bound
        assert bound - elapsed < 0.25 + 1e-9  # and it waits until within one pause of it


def test_the_served_default_covers_a_promotion_and_fits_envoys_message_timeout() -> None:
    from extproc.envoy_config import EnvoyPorts

    s = Settings()
    # Sentinel down-after 1-5 s promotes in about down-after + 1.3 s (measured 2.3 s at 1 s);
    # Cluster node timeout 2 s promoted in 3.9 s
    assert s.redis_failover_wait_s >= 6.5
    # Envoy must not give up on the processor first: the wait, the last call's own timeout
    # (250 ms, x2 with the stall retry) and margin
    assert EnvoyPorts().message_timeout_ms / 1000 >= s.redis_failover_wait_s + 2
