"""Giving back: what allowances hold beyond their time, their share of a shrunk room, or an
admission's need goes back to Redis (refunds through ``settle.lua``, retried by the sweeper)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from extproc.core.keys import EXPIRY_SLACK_MS
from extproc.core.rules import Adjustment, BucketCharge
from extproc.limiter.allowance.sizing import share_of_room
from extproc.limiter.allowance.state import IDLE_MS, Bucket, Lease
from extproc.limiter.allowance.tranches import Tranches
from extproc.limiter.base import SettleCall


class Returns(Tranches):
    """Give-backs and the sweeper."""

    def _queue_returns(self, back: dict[str, list[Adjustment]]) -> None:
        """Send these give-backs in the background (the sweeper retries what fails)."""
        if not back:
            return
        for tag, adj in back.items():
            self._returns.append(self._return_call(tag, adj))
        if not self._closed:
            task = asyncio.get_running_loop().create_task(self._flush_returns())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _return_call(self, tag: str, adj: list[Adjustment]) -> SettleCall:
        ledger = f"{tag}:req:allowance.{self._instance}.{next(self._serial)}"
        return SettleCall(ledger, adj, self.settings.return_ledger_ttl_ms)

    def _release(self, st: Bucket, units: int, back: dict[str, list[Adjustment]] | None) -> None:
        """Give back ``units`` of what ``st`` holds: the never-opened part first (opened with
        tranche.lua, then refunded: no reclaim can refund it twice), the rest into ``back``
        (``None``: the caller gives the opened part back itself)."""
        units = min(units, st.units)
        closed = min(units, st.closed)
        st.units -= units
        st.closed -= closed
        if closed:
            st.releasing += closed
            self._schedule_open(st.tag)
        if back is not None and units > closed:
            back.setdefault(st.tag, []).append(Adjustment(st.key, closed - units, st.expire_at_ms))

    def _trim(self, st: Bucket, value: int, back: dict[str, list[Adjustment]]) -> None:
        """The room left shrank (other replicas used it): what this replica holds beyond
        ``share`` of it goes back, so that it does not keep the others from the rest."""
        cap = max(0, share_of_room(st.limit, value, self.settings.share_ppm))
        excess = st.units - cap
        if excess > 0 and excess >= max(st.largest, 1):
            self._release(st, excess, back)

    def _give_back_short(self, buckets: Sequence[BucketCharge], now: int) -> SettleCall | None:
        """The rest of each allowance too short for this admission, as a refund riding on it."""
        short = [
            st
            for c in buckets
            if (st := self._states.get(c.key)) is not None
            and st.units > 0
            and (st.units < c.amount or now >= st.deadline_ms)
        ]
        if not short:
            return None
        tag = short[0].tag
        lease = self._leases.get(tag)
        mine = [st for st in self._states.values() if st.tag == tag]
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
            adj = [Adjustment(key, -n, self._states[key].expire_at_ms) for key, n in units.items()]
            call = SettleCall(lease.ledger, adj, self.settings.return_ledger_ttl_ms)
            self._leases[tag] = Lease(f"{tag}:req:allow.{self._instance}.{next(self._serial)}")
            return call
        adj = []
        for st in short:
            opened = st.units - st.closed
            self._release(st, st.units, None)  # the never-opened part: in the background
            if opened > 0:
                adj.append(Adjustment(st.key, -opened, st.expire_at_ms))
        return self._return_call(tag, adj) if adj else None

    def sweep(self) -> None:
        """Give back what allowances past their time hold; drop those whose window ended and
        the states nobody used for a while (queued: :meth:`_flush_returns` sends them)."""
        now = self.clock.now_ms()
        back: dict[str, list[Adjustment]] = {}
        for key, st in list(self._states.items()):
            if now + EXPIRY_SLACK_MS >= st.expire_at_ms:
                if st.units:
                    self._count("expired", st.units)
                if not st.taking:
                    del self._states[key]
                st.units = st.closed = st.releasing = 0
                continue
            if st.units and now >= st.deadline_ms:
                self._release(st, st.units, back)
            elif (
                not st.units
                and not st.releasing
                and not st.taking
                and now - st.touched_ms > IDLE_MS
            ):
                del self._states[key]
        for tag, adj in back.items():
            self._returns.append(self._return_call(tag, adj))

    async def _sweep_loop(self) -> None:
        # a quarter of an allowance's time, and often enough to renew the allowance ledgers'
        # leases every third of theirs
        tick = max(min(self.settings.ttl_ms / 4000, self.settings.lease_ms / 6000), 0.05)
        while True:
            await asyncio.sleep(tick)
            self.sweep()
            for tag in list(self._leases):
                if any(st.tag == tag and st.releasing for st in self._states.values()):
                    self._schedule_open(tag)
            if self._returns:
                await self._flush_returns()
            await self._renew_leases()

    async def _flush_returns(self) -> None:
        await self._release_now()
        calls, self._returns = self._returns, []
        if not calls:
            return
        try:
            results = await self.inner.settle_many(calls)
        except Exception:
            results = [None] * len(calls)
        for call, r in zip(calls, results, strict=True):
            if r is None:
                self._returns.append(call)  # idempotent by its ledger: sent again
            elif r:
                self._count("returned", -sum(a.amount for a in call.adjustments))

    async def give_back(self) -> None:
        """Give back everything held now (shutdown; tests)."""
        for st in self._states.values():
            st.deadline_ms = 0
        self.sweep()
        await self._flush_returns()

    def _unreturned(self) -> int:
        return -sum(a.amount for c in self._returns for a in c.adjustments)
