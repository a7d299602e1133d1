"""Tranches: a grant is drawn from only as far as it is opened; the rest is recorded in the
replica's allowance ledger for the tenant (leased, renewed while the replica lives) and opened
with ``tranche.lua``, a tranche at a time, or to be given back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

from extproc.core.rules import Adjustment, BucketCharge
from extproc.limiter.allowance.sizing import to_open
from extproc.limiter.allowance.state import AllowanceBackend, Book, Bucket, Lease


def new_lease(book: Book, tag: str) -> Lease:
    """A new allowance ledger for the tenant of ``tag`` (none recorded in it yet)."""
    return Lease(f"{tag}:req:allow.{book.instance}.{book.serial()}")


class Tranches:
    """Opening tranches and keeping the allowance ledgers' leases; the never-opened units
    being given back are opened, then handed to ``refund`` (the give-backs)."""

    def __init__(
        self,
        book: Book,
        backend: AllowanceBackend,
        refund: Callable[[dict[str, list[Adjustment]]], None],
    ) -> None:
        self.book = book
        self.backend = backend
        self._refund = refund

    def lease(self, tag: str) -> Lease:
        """The tenant's allowance ledger (a new one when it has none)."""
        lease = self.book.leases.get(tag)
        if lease is None:
            lease = self.book.leases[tag] = new_lease(self.book, tag)
        return lease

    def drop_closed(self, tag: str) -> None:
        """The tenant's allowance ledger was reclaimed: forget its never-opened units."""
        for st in self.book.states.values():
            if st.tag == tag and (st.closed or st.releasing):
                st.units -= st.closed
                st.closed = 0
                st.releasing = 0

    @staticmethod
    def needs_open(st: Bucket) -> bool:
        """Whether the open part of ``st`` fell under half a tranche."""
        return st.closed > 0 and st.units - st.closed < max(st.tranche // 2, st.largest, 1)

    def open_short(self, buckets: Sequence[BucketCharge]) -> None:
        """An allowance that holds the amount but has not opened enough of it: open the next
        tranche now (this call goes to Redis; the next ones draw from it)."""
        for c in buckets:
            st = self.book.states.get(c.key)
            if (
                st is not None
                and st.closed
                and not st.taking  # the take in flight opens what it needs itself
                and st.units - st.closed < c.amount <= st.units
            ):
                self.schedule_open(st.tag)

    def open_ahead(self, plan: Sequence[Bucket]) -> None:
        """Open the next tranche, in the background, of each allowance half drawn."""
        for st in plan:
            if self.needs_open(st) and not st.taking:  # a take in flight opens it itself
                self.schedule_open(st.tag)

    def schedule_open(self, tag: str) -> None:
        """Open the tenant's due tranches in the background (one call in flight at most)."""
        lease = self.lease(tag)
        if lease.opening or self.book.closed or not lease.gen:
            return
        lease.opening = True
        lease.task = self.book.spawn(self._open(tag, lease))

    async def _open(self, tag: str, lease: Lease) -> None:
        """tranche.lua for the tenant: open a tranche of each allowance that needs one and
        the never-opened units being given back (then refunded as opened ones)."""
        try:
            for _ in range(4):  # what became due meanwhile, a few times at most
                plan: list[tuple[Bucket, int, int]] = []
                for st in self.book.states.values():
                    if st.tag != tag:
                        continue
                    # a tranche of each that needs one, and what brings the others nearly
                    # due up to one and a half (riding on this call, not one of their own);
                    # none of one whose take is in flight (the take opens what it needs:
                    # both would leave more than one and a half tranches open)
                    ahead = 0
                    if not st.taking:
                        ahead = to_open(st.units - st.closed, st.closed, st.tranche, st.largest)
                    if ahead or st.releasing:
                        plan.append((st, st.releasing, ahead))
                if not lease.gen or not any(
                    rel or (ahead and self.needs_open(st)) for st, rel, ahead in plan
                ):
                    return
                gen = lease.gen
                opener = getattr(self.backend, "open_tranches", None)
                if opener is None:
                    return
                items = [(st.key, rel + ahead) for st, rel, ahead in plan]
                for st, _, ahead in plan:
                    st.opening = ahead  # a take sent meanwhile counts them as open
                try:
                    ok: bool | None = await opener(lease.ledger, gen, items)
                except Exception:
                    ok = None
                finally:
                    for st, _, _ in plan:
                        st.opening = 0
                self.book.stats.opens += 1
                if ok is None:
                    return  # the sweeper tries again
                if lease.gen != gen:
                    return  # a newer ledger meanwhile: this one's units were dropped already
                if not ok:  # reclaimed (a lease renewal lost): its record went back already
                    self.drop_closed(tag)
                    lease.gen = ""
                    return
                back: dict[str, list[Adjustment]] = {}
                for st, rel, ahead in plan:
                    st.releasing -= rel
                    opened = min(ahead, st.closed)
                    st.closed -= opened
                    # what a give-back moved out of ``closed`` meanwhile: opened, so refunded
                    refund = rel + ahead - opened
                    st.releasing -= ahead - opened
                    if refund > 0:
                        back.setdefault(tag, []).append(
                            Adjustment(st.key, -refund, st.expire_at_ms)
                        )
                if back:
                    self._refund(back)
        finally:
            lease.opening = False

    async def renew_leases(self, force: bool = False) -> None:
        """Renew the allowance ledgers that still record never-opened units (every third
        of the lease), as the gateway renews its reservations."""
        book = self.book
        now = book.clock.now_ms()
        s = book.settings
        held = {st.tag for st in book.states.values() if st.closed or st.releasing}
        due = [
            lease.ledger
            for tag, lease in book.leases.items()
            if tag in held and lease.gen and (force or now - lease.renewed_ms >= s.lease_ms // 3)
        ]
        if not due:
            return
        with contextlib.suppress(Exception):
            await self.backend.renew(due, now + s.lease_ms)
            for lease in book.leases.values():
                if lease.ledger in due:
                    lease.renewed_ms = now

    async def release_now(self) -> None:
        """Open (then refund) the never-opened units being given back, now."""
        for tag, lease in list(self.book.leases.items()):
            if lease.task is not None and not lease.task.done():
                with contextlib.suppress(Exception):
                    await asyncio.shield(lease.task)
            if not lease.opening and any(
                st.tag == tag and st.releasing for st in self.book.states.values()
            ):
                lease.opening = True
                await self._open(tag, lease)
