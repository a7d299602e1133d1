"""The journal of acknowledged charges: bounded by age while Redis answers, by size always, and
never replaying an entry whose idempotency key may be gone."""

from __future__ import annotations

import pytest

from extproc.limiter.journal import Entry, Journal

pytestmark = pytest.mark.unit


def entry(at: float, *, slot: int = 0, ttl: float = 60.0) -> Entry:
    return Entry(at, at + ttl, "charge", [f"k{at}"], [1], slot, "run-a")


def test_confirm_drops_only_entries_older_than_the_window() -> None:
    j = Journal(window_s=10.0)
    for t in (0.0, 5.0, 12.0):
        j.add(entry(t))
    j.confirm(now=16.0)  # horizon 6: the entries at 0 and 5 go
    assert [e.at for e in j] == [12.0]
    assert j.holds(0) and not j.holds(1)


def test_without_confirm_entries_outlive_the_window() -> None:
    """During an outage nobody confirms: the journal keeps everything (size-bounded)."""
    j = Journal(window_s=1.0)
    for t in range(5):
        j.add(entry(float(t)))
    assert len(j) == 5


def test_size_bound_drops_the_oldest_and_counts_them() -> None:
    j = Journal(window_s=10.0, max_entries=3)
    for t in range(5):
        j.add(entry(float(t), slot=t))
    assert [e.at for e in j] == [2.0, 3.0, 4.0]
    assert j.dropped == 2
    assert not j.holds(0) and not j.holds(1) and j.holds(4)


def test_replayable_skips_entries_whose_key_may_have_expired() -> None:
    j = Journal(window_s=10.0)
    j.add(entry(0.0, ttl=5.0))
    j.add(entry(1.0, ttl=60.0))
    assert [e.at for e in j.replayable(now=6.0)] == [1.0]


def test_holds_counts_per_slot() -> None:
    j = Journal(window_s=1.0)
    j.add(entry(0.0, slot=7))
    j.add(entry(0.5, slot=7))
    j.confirm(now=1.2)  # drops the first only
    assert j.holds(7)
    j.confirm(now=2.0)
    assert not j.holds(7) and len(j) == 0


def test_rejects_a_useless_journal() -> None:
    with pytest.raises(ValueError):
        Journal(window_s=0)
