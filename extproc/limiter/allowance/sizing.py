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
    the open part (``opened`` before the take) up to one and a half tranches is open at once,
    the most a tranche opening leaves open (:func:`to_open`): a take made when an opening was
    due (:func:`take_due`) opens that tranche itself."""
    return granted - max(0, min(granted, tranche + tranche // 2 - opened))


def take_due(units: int, want: int, tranche: int, closed: int, *, opening: bool) -> bool:
    """Whether a bucket holding ``units`` (``closed`` of them never opened, in tranches of
    ``tranche``) of the ``want`` it asks for is due a take.  With a tranche opening due
    (``opening``): when that opening would leave it under half of ``want`` (the take opens
    the tranche itself: one call, not two).  With tranches still to open and none due: only
    when under a quarter (the demand rose); the take waits for the next opening, which comes
    before it runs short.  Otherwise under half."""
    if opening:
        return (units - tranche) * 2 < want
    if closed > 0:
        return units * 4 < want
    return units * 2 < want


def tops_up(units: int, want: int, least: int) -> bool:
    """Whether a bucket holding ``units`` of its ``want`` rides along on a take another
    bucket of the same tenant is due: when what it lacks is worth taking (at least ``least``,
    its largest recent amount; the call is made anyway)."""
    return want - units >= max(least, 1)


def to_open(opened: int, closed: int, tranche: int, least: int) -> int:
    """What a tranche opening opens of an allowance with ``opened`` units open and ``closed``
    never opened: a tranche when the open part fell under half of one (or under ``least``,
    the largest request), else, riding on a call made for another bucket of the tenant, what
    brings an open part under one tranche up to one and a half; the open part never passes
    one and a half tranches (or a tranche and ``least``), the bound a SIGKILL leaks."""
    if closed <= 0:
        return 0
    if opened < max(tranche // 2, least, 1):
        return min(closed, tranche)
    if opened < tranche:
        return min(closed, tranche + tranche // 2 - opened)
    return 0
