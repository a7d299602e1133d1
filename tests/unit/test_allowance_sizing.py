"""Allowance sizing (extproc/limiter/allowance/sizing.py): the arithmetic of what a bucket
wants, the share of the room it may hold, what a take grants and how a grant splits into
tranches, with the invariants docs/semantics.md states."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.limiter.allowance.sizing import (
    closed_of_grant,
    grant,
    share_of_room,
    tranche_size,
    wanted,
)

pytestmark = pytest.mark.unit

units = st.integers(min_value=0, max_value=10**9)
ppm = st.integers(min_value=0, max_value=1_000_000)


def test_a_worked_example() -> None:
    # 10 % of the 8,000 units left is 800; 300 already held: 500 more, not the 1,000 wanted
    assert share_of_room(10_000, 2_000, 100_000) == 800
    assert grant(1_000, 10_000, 2_000, 100_000, held=300, least=10) == 500
    # 800 held after the take, in 4 tranches of 200; 100 were open: 200 more open at once
    # (up to one and a half tranches, as an opening leaves it), 300 closed
    assert tranche_size(300, 500, 4, 10) == 200
    assert closed_of_grant(500, 200, 100) == 300
    # 3,000 units over 1.5 s drawn here, an allowance of 2 s: 4,000 plus a quarter
    assert wanted(3_000, 1_500, 2_000, 50) == 5_000
    assert wanted(0, 0, 2_000, 50) == 200  # four of the largest
    assert wanted(0, 0, 2_000, 0) == 1


@given(limit=units, value=units, share_ppm=ppm)
def test_the_share_of_the_room_never_exceeds_share_times_room(
    limit: int, value: int, share_ppm: int
) -> None:
    s = share_of_room(limit, value, share_ppm)
    assert s * 1_000_000 <= (limit - value) * share_ppm < (s + 1) * 1_000_000


@given(
    want=units,
    limit=units,
    value=units,
    share_ppm=ppm,
    held=units,
    least=st.integers(min_value=0, max_value=10**6),
)
def test_a_grant_keeps_held_plus_grant_within_the_share_of_the_room(
    want: int, limit: int, value: int, share_ppm: int, held: int, least: int
) -> None:
    g = grant(want, limit, value, share_ppm, held=held, least=least)
    assert 0 <= g <= want
    if g:
        # held + grant <= share x room, and never less than the largest recent amount
        assert (held + g) * 1_000_000 <= (limit - value) * share_ppm
        assert g >= max(1, least)
        assert g == min(want, share_of_room(limit, value, share_ppm) - held)  # all it may
    elif limit > value:
        # nothing only when what it could grant is under one unit or the largest amount
        assert min(want, share_of_room(limit, value, share_ppm) - held) < max(1, least)


@given(
    data=st.data(),
    held=st.integers(min_value=0, max_value=10**7),
    granted=st.integers(min_value=1, max_value=10**7),
    tranches=st.integers(min_value=1, max_value=64),
    least=st.integers(min_value=0, max_value=10**5),
)
def test_tranches_cover_the_allowance_and_the_grant_splits_into_them(
    data: st.DataObject, held: int, granted: int, tranches: int, least: int
) -> None:
    opened = data.draw(st.integers(min_value=0, max_value=held), label="opened")
    tranche = tranche_size(held, granted, tranches, least)
    assert tranche >= max(least, 1)
    assert tranche * tranches >= held + granted  # the tranches cover what is held
    closed = closed_of_grant(granted, tranche, opened)
    assert 0 <= closed <= granted
    open_now = granted - closed
    # the open part is brought up to one and a half tranches (no more) before anything
    # stays closed: what a SIGKILL leaks stays within 1.5 tranches
    assert opened + open_now <= max(opened, tranche + tranche // 2)
    if closed:
        assert opened + open_now >= tranche + tranche // 2
        assert open_now == max(0, tranche + tranche // 2 - opened)
    # what stays closed opens a tranche at a time: at most tranches - 1 openings
    openings = []
    left = closed
    while left:
        openings.append(min(left, tranche))
        left -= openings[-1]
    assert sum(openings) == closed
    assert len(openings) <= tranches - 1


@given(
    drawn=st.integers(min_value=0, max_value=10**9),
    more=st.integers(min_value=0, max_value=10**6),
    elapsed_ms=st.integers(min_value=-1_000, max_value=10**7),
    ttl_ms=st.integers(min_value=1, max_value=10**6),
    largest=st.integers(min_value=0, max_value=10**6),
)
def test_what_a_bucket_wants_covers_its_rate_over_an_allowances_time(
    drawn: int, more: int, elapsed_ms: int, ttl_ms: int, largest: int
) -> None:
    w = wanted(drawn, elapsed_ms, ttl_ms, largest)
    assert w >= max(1, 4 * largest)
    assert w * max(elapsed_ms, 100) >= drawn * ttl_ms  # the rate drawn here, over ttl_ms
    assert wanted(drawn + more, elapsed_ms, ttl_ms, largest) >= w  # more drawn: no less wanted
