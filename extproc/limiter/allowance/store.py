"""The allowances in Redis: takes (``allowance.lua``), tranche openings (``tranche.lua``) and
the draft ledgers (``drafts.lua``), each script's arguments packed here, next to the code that
uses them, and sent through the limiter's :class:`extproc.limiter.caller.RedisCaller`.
:class:`extproc.limiter.redis.RedisLimiter` offers them as its own methods."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from extproc.core.keys import open_key
from extproc.errors import LimiterUnavailable
from extproc.limiter.base import AllowanceGrant, AllowanceLease, AllowanceTake
from extproc.limiter.caller import RedisCaller, Where
from extproc.limiter.layout import CALL_ID_TTL_MS, Packed, call_id_key, reclaimed, text

#: allowance.lua's second argument: "0" a take (refused beyond the share), "1" its replay.
_TAKE, _REPLAY = "0", "1"


def takes(
    call_id: str, items: Sequence[AllowanceTake], lease: AllowanceLease | None, *, replay: bool
) -> Packed:
    """An ``allowance.lua`` call of ``items`` (one tenant): KEYS the call id's key, each
    counter, then with a lease the allowance ledger and the tenant's open reservations; ARGV
    the call id's TTL, take or replay, 7 values per counter (want, limit, expire-at, share,
    least, held, opened), then the lease's (now, until, tranches, ledger TTL)."""
    first = items[0].key
    p = Packed([call_id_key(first, call_id)] + [t.key for t in items])
    p.args = [CALL_ID_TTL_MS, _REPLAY if replay else _TAKE]
    for t in items:
        p.args += [t.want, t.limit, t.expire_at_ms, t.share_ppm, t.least, t.held, t.opened]
    if lease is not None:
        p.keys += [lease.ledger, open_key(lease.ledger)]
        p.args += [lease.now_ms, lease.until_ms, max(lease.tranches, 1), lease.ttl_ms]
    return p


def tranches(call_id: str, ledger: str, gen: str, items: Sequence[tuple[str, int]]) -> Packed:
    """A ``tranche.lua`` call: KEYS the call id's key, the allowance ledger, each counter;
    ARGV the call id's TTL, the ledger's generation, the units to open per counter."""
    keys = [call_id_key(ledger, call_id), ledger] + [k for k, _ in items]
    return Packed(keys, [CALL_ID_TTL_MS, gen] + [units for _, units in items])


def drafts(
    ledger: str,
    until_ms: int,
    ttl_ms: int,
    *,
    keep: Sequence[tuple[str, int, str]],
    charged: Sequence[tuple[str, int]],
    drop: Sequence[str],
    more: Sequence[tuple[str, int]],
) -> Packed:
    """A ``drafts.lua`` call (see :meth:`AllowanceStore.keep_drafts`)."""
    p = Packed([ledger, open_key(ledger)] + [led for led, _ in more])
    p.args = [until_ms, ttl_ms, len(keep), len(charged), len(drop)]
    for led, amount, draft in keep:
        p.args += [led, amount, draft]
    for led, amount in charged:
        p.args += [led, amount]
    p.args += list(drop)
    p.args += [n for _, n in more]
    return p


class AllowanceStore:
    """The allowance scripts on a :class:`RedisCaller`."""

    def __init__(self, caller: RedisCaller) -> None:
        self.caller = caller
        for name in ("allowance", "tranche", "drafts"):
            caller.register(name)

    async def take_allowances(
        self, items: list[AllowanceTake], lease: AllowanceLease | None = None
    ) -> list[AllowanceGrant | None]:
        """Take allowances, one call per Cluster slot (as the limiter's batches): per item
        (granted, value after, ...), None when its call failed.  Each call carries a fresh
        id, so a retry after a timeout grants nothing twice; a take that granted is
        journalled and replayed, with its grants, to a new master after a failover (the units
        the replica holds stay counted).  With a ``lease`` (every item of the lease ledger's
        tenant), the grants are recorded in tranches in that ledger."""
        calls: dict[int, str] = {}

        def pack(idx: list[int]) -> Packed:
            calls[idx[0]] = call_id = uuid.uuid4().hex
            return takes(call_id, [items[i] for i in idx], lease, replay=False)

        def read(idx: list[int], res: Any, where: Where) -> list[AllowanceGrant]:
            grants, units, gen = res[0], int(res[1]), text(res[2])
            dead = reclaimed(res[3] if len(res) > 3 else [])
            out = [
                AllowanceGrant(
                    int(v[0]), int(v[1]), gen, units if n == 0 else 0, dead if n == 0 else ()
                )
                for n, v in enumerate(grants)
            ]
            if any(g.granted > 0 for g in out):
                granted = [_with_want(items[i], g.granted) for i, g in zip(idx, out, strict=True)]
                replay = takes(calls[idx[0]], granted, lease, replay=True)
                self.caller.journal("allowance", replay, CALL_ID_TTL_MS, where)
            return out

        return await self.caller.batched(
            "an allowance", "allowance", [t.key for t in items], pack, read
        )

    async def open_tranches(
        self, ledger: str, gen: str, items: list[tuple[str, int]]
    ) -> bool | None:
        """Open allowance tranches (one call: every counter of the ledger's tenant);
        journalled like a take, so a new master's record is not left higher than what the
        replica has unopened."""
        if not items:
            return True
        packed = tranches(uuid.uuid4().hex, ledger, gen, items)
        where = self.caller.owner(ledger)
        try:
            res = await self.caller.run("an allowance tranche", "tranche", packed, where)
        except LimiterUnavailable:
            return None
        if int(res) == 1:
            self.caller.journal("tranche", packed, CALL_ID_TTL_MS, where)
        return int(res) == 1

    async def keep_drafts(
        self,
        ledger: str,
        until_ms: int,
        ttl_ms: int,
        *,
        keep: Sequence[tuple[str, int, str]],
        charged: Sequence[tuple[str, int]],
        drop: Sequence[str],
        more: Sequence[tuple[str, int]] = (),
    ) -> bool | None:
        """Keep (request ledger, charged, draft), update (request ledger, charged) and drop
        (request ledger) usage-record drafts in a replica's draft ledger ``ledger``, renewing
        its lease to ``until_ms``; one call, in the ledger's slot.  True when the ledger held
        the earlier drafts, False when it was created anew (the caller sends every draft
        again), None when the call failed (the caller sends it again).  ``more``: (request
        ledger, tokens) added to the "charged" of Redis-admitted requests whose stream
        charges were drawn from allowances, while their ledgers are open."""
        packed = drafts(ledger, until_ms, ttl_ms, keep=keep, charged=charged, drop=drop, more=more)
        where = (self.caller.slot(ledger), "")
        try:
            res = await self.caller.run("usage-record drafts", "drafts", packed, where)
        except LimiterUnavailable:
            return None
        return int(res) == 1


def _with_want(t: AllowanceTake, granted: int) -> AllowanceTake:
    """``t`` asking for what was granted (a replay grants that again, never more)."""
    return AllowanceTake(
        t.key, granted, t.limit, t.expire_at_ms, t.share_ppm, t.least, t.held, t.opened
    )
