"""Allowance sizing, as plain arithmetic: what a bucket wants to hold, the share of the room
left it may hold, what a take grants and how a grant splits into tranches.

``allowance.lua`` grants by the same rules in Redis; the in-memory limiter grants with
:func:`grant`, :func:`tranche_size` and :func:`closed_of_grant`
(tests/integration/test_allowances.py runs the same tests on both)."""

from __future__ import annotations

import math


def share_of_room(limit: int, value: int, share_ppm: int) -> int:
    """``share`` (parts per million) of the room a counter at ``value`` leaves under ``limit``,
    rounded down (negative past the limit)."""
    return (limit - value) * share_ppm // 1_000_000


def wanted(drawn: int, elapsed_ms: int, ttl_ms: int, largest: int) -> int:
    """What a bucket asks to hold: the units drawn here over one allowance's time (``ttl_ms``,
    at the rate of ``drawn`` over ``elapsed_ms``, at least 100 ms, plus a quarter), at least
    four of the largest recent amounts, at least one."""
    elapsed = max(elapsed_ms, 100)
    per_ms = drawn / elapsed
    return max(math.ceil(per_ms * ttl_ms * 1.25), 4 * largest, 1)


def grant(want: int, limit: int, value: int, share_ppm: int, *, held: int, least: int) -> int:
    """What a take grants: at most ``want``, and at most the share of the room left net of
    what the replica already ``held`` (held + grant <= share x room); nothing when that is less
    than ``least`` (the largest recent amount) or one unit."""
    g = min(want, share_of_room(limit, value, share_ppm) - held) if limit > value else 0
    return g if g >= max(1, least) else 0


def tranche_size(held: int, granted: int, tranches: int, least: int) -> int:
    """One tranche of an allowance that holds ``held + granted`` after a take: that split in
    ``tranches`` parts (rounded up: they cover it), and at least ``least``."""
    return max(-(-(held + granted) // max(tranches, 1)), least)


def closed_of_grant(granted: int, tranche: int, opened: int) -> int:
    """Of a grant, what is not open at once (recorded in the allowance ledger): what brings
    the open part (``opened`` before the take) up to one tranche is open at once."""
    return granted - max(0, min(granted, tranche - opened))
