"""Giving back: what allowances hold beyond their time, their share of a shrunk room, or an
admission's need goes back to Redis (refunds through ``settle.lua``, retried by the sweeper)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from extproc.core.keys import EXPIRY_SLACK_MS
from extproc.core.rules import Adjustment, BucketCharge
from extproc.limiter.allowance.sizing import share_of_room
from extproc.limiter.allowance.state import IDLE_MS, AllowanceBackend, Book, Bucket
from extproc.limiter.allowance.tranches import Tranches, new_lease
from extproc.limiter.base import SettleCall


class Returns:
    """Give-backs and the sweeper."""

    def __init__(self, book: Book, backend: AllowanceBackend, tranches: Tranches) -> None:
        self.book = book
        self.backend = backend
        self.tranches = tranches

    def queue(self, back: dict[str, list[Adjustment]]) -> None:
        """Send these give-backs in the background (the sweeper retries what fails)."""
        if not back:
            return
        self.add(back)
        if not self.book.closed:
            self.book.spawn(self.flush())

    def add(self, back: dict[str, list[Adjustment]]) -> None:
        """Queue these give-backs for the next flush."""
        for tag, adj in back.items():
            self.book.returns.append(self.call(tag, adj))

    def call(self, tag: str, adj: list[Adjustment]) -> SettleCall:
        """A give-back of ``adj``: the settlement of a ledger of its own."""
        book = self.book
        ledger = f"{tag}:req:allowance.{book.instance}.{book.serial()}"
        return SettleCall(ledger, adj, book.settings.return_ledger_ttl_ms)

    def release(self, st: Bucket, units: int, back: dict[str, list[Adjustment]] | None) -> None:
        """Give back ``units`` of what ``st`` holds: the never-opened part first (opened with
        tranche.lua, then refunded: no reclaim can refund it twice), the rest into ``back``
        (``None``: the caller gives the opened part back itself)."""
        units = min(units, st.units)
        closed = min(units, st.closed)
        st.units -= units
        st.closed -= closed
        if closed:
            st.releasing += closed
            self.tranches.schedule_open(st.tag)
        if back is not None and units > closed:
            back.setdefault(st.tag, []).append(Adjustment(st.key, closed - units, st.expire_at_ms))

    def trim(self, st: Bucket, value: int, back: dict[str, list[Adjustment]]) -> None:
        """The room left shrank (other replicas used it): what this replica holds beyond
        ``share`` of it goes back, so that it does not keep the others from the rest."""
        cap = max(0, share_of_room(st.limit, value, self.book.settings.share_ppm))
        excess = st.units - cap
        if excess > 0 and excess >= max(st.largest, 1):
            self.release(st, excess, back)

    def give_back_short(self, buckets: Sequence[BucketCharge], now: int) -> SettleCall | None:
        """The rest of each allowance too short for this admission, as a refund riding on it."""
        book = self.book
        short = [
            st
            for c in buckets
            if (st := book.states.get(c.key)) is not None
            and st.units > 0
            and (st.units < c.amount or now >= st.deadline_ms)
        ]
        if not short:
            return None
        tag = short[0].tag
        lease = book.leases.get(tag)
        mine = [st for st in book.states.values() if st.tag == tag]
        if (
            lease is not None
            and lease.gen
            and not lease.opening
            and not any(st.taking for st in mine)
            and any(st.closed or st.releasing for st in mine)
        ):
            # settle the allowance ledger itself, riding on this admission: its never-opened
            # units (every bucket of the tenant's) and the short ones' opened rest go back at
            # once, the ledger is closed (no reclaim refunds it again; one reclaimed meanwhile
            # has its refund put back first, settle_lib.lua), and the next take opens another
            units: dict[str, int] = {}
            for st in mine:
                give = st.closed + st.releasing + (st.units - st.closed if st in short else 0)
                st.units -= give - st.releasing
                st.closed = st.releasing = 0
                if give:
                    units[st.key] = give
            adj = [Adjustment(key, -n, book.states[key].expire_at_ms) for key, n in units.items()]
            call = SettleCall(lease.ledger, adj, book.settings.return_ledger_ttl_ms)
            book.leases[tag] = new_lease(book, tag)
            return call
        adj = []
        for st in short:
            opened = st.units - st.closed
            self.release(st, st.units, None)  # the never-opened part: in the background
            if opened > 0:
                adj.append(Adjustment(st.key, -opened, st.expire_at_ms))
        return self.call(tag, adj) if adj else None

    def sweep(self) -> None:
        """Give back what allowances past their time hold; drop those whose window ended and
        the states nobody used for a while (queued: :meth:`flush` sends them)."""
        book = self.book
        now = book.clock.now_ms()
        back: dict[str, list[Adjustment]] = {}
        for key, st in list(book.states.items()):
            if now + EXPIRY_SLACK_MS >= st.expire_at_ms:
                if st.units:
                    book.tally.units("expired", st.units)
                if not st.taking:
                    del book.states[key]
                st.units = st.closed = st.releasing = 0
                continue
            if st.units and now >= st.deadline_ms:
                self.release(st, st.units, back)
            elif (
                not st.units
                and not st.releasing
                and not st.taking
                and now - st.touched_ms > IDLE_MS
            ):
                del book.states[key]
        self.add(back)

    async def sweep_loop(self) -> None:
        """Sweep, send the give-backs and renew the allowance ledgers, forever."""
        # a quarter of an allowance's time, and often enough to renew the allowance ledgers'
        # leases every third of theirs
        s = self.book.settings
        tick = max(min(s.ttl_ms / 4000, s.lease_ms / 6000), 0.05)
        while True:
            await asyncio.sleep(tick)
            self.sweep()
            for tag in list(self.book.leases):
                if any(st.tag == tag and st.releasing for st in self.book.states.values()):
                    self.tranches.schedule_open(tag)
            if self.book.returns:
                await self.flush()
            await self.tranches.renew_leases()

    async def flush(self) -> None:
        """Send the queued give-backs (what fails stays queued)."""
        await self.tranches.release_now()
        book = self.book
        calls, book.returns = book.returns, []
        if not calls:
            return
        try:
            results = await self.backend.settle_many(calls)
        except Exception:
            results = [None] * len(calls)
        for call, r in zip(calls, results, strict=True):
            if r is None:
                book.returns.append(call)  # idempotent by its ledger: sent again
            elif r:
                book.tally.units("returned", -sum(a.amount for a in call.adjustments))

    async def give_back(self) -> None:
        """Give back everything held now (shutdown; tests)."""
        for st in self.book.states.values():
            st.deadline_ms = 0
        self.sweep()
        await self.flush()

    def unreturned(self) -> int:
        """Units queued to go back and not sent yet."""
        return -sum(a.amount for c in self.book.returns for a in c.adjustments)
