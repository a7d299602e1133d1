"""Taking allowances: what this replica sees of each bucket (its rate, its demand, the counter
Redis answered with) and the takes (``allowance.lua``) of the buckets that run short."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.core.keys import EXPIRY_SLACK_MS, counter_name
from extproc.core.rules import Adjustment, BucketCharge
from extproc.limiter.allowance.returns import Returns
from extproc.limiter.allowance.sizing import (
    closed_of_grant,
    share_of_room,
    take_due,
    tops_up,
    tranche_size,
    wanted,
)
from extproc.limiter.allowance.state import MAX_LEDGERS, MAX_STATES, AllowanceBackend, Book, Bucket
from extproc.limiter.allowance.tranches import Tranches
from extproc.limiter.base import AllowanceGrant, AllowanceLease, AllowanceTake


class Taker:
    """Each bucket's observed demand and the takes that follow it."""

    def __init__(
        self, book: Book, backend: AllowanceBackend, tranches: Tranches, returns: Returns
    ) -> None:
        self.book = book
        self.backend = backend
        self.tranches = tranches
        self.returns = returns

    def _state(self, c: BucketCharge, now: int) -> Bucket | None:
        states = self.book.states
        st = states.get(c.key)
        if st is None:
            if len(states) >= MAX_STATES:
                return None
            name = counter_name(c.key)
            assert name is not None
            st = states[c.key] = Bucket(
                c.key, name.tag, c.limit, c.expire_at_ms, since_ms=now, touched_ms=now
            )
        st.limit = c.limit
        return st

    def observe(self, buckets: Sequence[BucketCharge], now: int, *, admission: bool = True) -> None:
        """Count a limiter call (an admission or a stream charge) of these buckets on this
        replica: the rate and the size of its allowances follow."""
        second = now // 1000
        for c in buckets:
            st = self._state(c, now)
            if st is None:
                continue
            if second != st.second:
                st.hits_prev = st.hits if second == st.second + 1 else 0
                st.hits, st.second = 0, second
            st.hits += 1
            st.drawn += c.amount
            if admission:
                st.largest = max(st.largest, c.amount)
            st.touched_ms = now

    def saw(self, buckets: Sequence[BucketCharge], values: Sequence[int]) -> None:
        """Remember the counters' values Redis answered with (headers of local admissions),
        and give back what is held beyond ``share`` of the room they leave."""
        back: dict[str, list[Adjustment]] = {}
        for c, v in zip(buckets, values, strict=False):
            seen = self.book.states.get(c.key)
            if seen is not None:
                seen.seen = v
                self.returns.trim(seen, v, back)
        self.returns.queue(back)

    def refill(self, buckets: Sequence[BucketCharge], now: int) -> None:
        """Take (in the background) allowances for the buckets that run short."""
        s = self.book.settings
        states = self.book.states
        takes: list[AllowanceTake] = []
        busy = False
        for c in buckets:
            st = states.get(c.key)
            if st is not None and now < st.quiet_until_ms:
                return  # near its limit: an allowance of the others would not be drawn from
            if st is not None and max(st.hits, st.hits_prev) >= s.min_rate:
                busy = True
        if not busy:  # one busy bucket is enough: a request draws from all of its buckets
            return
        due = False
        for c in buckets:
            st = states.get(c.key)
            if st is None:
                continue
            if st.units and now < st.deadline_ms < now + s.ttl_ms // 2:
                # still drawn from: it stays (its size is bounded by the share at its take);
                # an allowance nobody draws from goes back within ``ttl_ms``
                st.deadline_ms = now + s.ttl_ms
            if st.taking:
                continue
            want = wanted(st.drawn, now - st.since_ms, s.ttl_ms, st.largest)
            if now + EXPIRY_SLACK_MS >= st.expire_at_ms:
                continue
            if take_due(st.units, want, st.tranche, st.closed, opening=Tranches.needs_open(st)):
                due = True
            elif not tops_up(st.units, want, st.largest):
                continue
            cap = share_of_room(st.limit, st.seen, s.share_ppm) - st.units
            if st.seen and cap < max(st.largest, 1):
                if st.units < c.amount:
                    return  # near its limit: the request's other allowances would not be drawn
                continue  # it holds its share of the room left already: a take grants nothing
            takes.append(
                AllowanceTake(
                    st.key,
                    want - st.units,
                    st.limit,
                    st.expire_at_ms,
                    s.share_ppm,
                    st.largest,
                    st.units,
                    # open, and being opened by a tranche call in flight: the take opens
                    # what brings them up to one and a half tranches, no more
                    st.units - st.closed + st.opening,
                )
            )
        if not due or not takes or self.book.closed:
            return  # (one bucket due is enough: the others that would soon be ride along)
        for t in takes:
            states[t.key].taking = True
        self.book.spawn(self._take(takes))

    async def _take(self, takes: list[AllowanceTake]) -> None:
        book = self.book
        s = book.settings
        tag = book.states[takes[0].key].tag
        lease = self.tranches.lease(tag)
        now = book.clock.now_ms()
        terms = AllowanceLease(
            lease.ledger,
            now,
            now + s.lease_ms,
            max(s.tranches, 1),
            s.max_window_s * 1000 + s.lease_ms + EXPIRY_SLACK_MS,
        )
        try:
            results: list[AllowanceGrant | None] = await self.backend.take_allowances(takes, terms)
        except Exception:  # a wrapped limiter that raises: no allowance, admission as before
            results = [None] * len(takes)
        now = book.clock.now_ms()
        near: dict[str, list[Adjustment]] = {}
        answered = [r for r in results if r is not None]
        if answered:
            lease.renewed_ms = now
            if answered[0].reclaimed:
                book.tally.units("reclaimed", answered[0].reclaimed)
            if answered[0].drafts and len(book.reclaimed) < MAX_LEDGERS:
                book.reclaimed.extend(answered[0].drafts)
            if answered[0].gen != lease.gen:
                # a new ledger: what the old one recorded was reclaimed (or lost): those
                # never-opened units are no longer this replica's to draw nor to give back
                self.tranches.drop_closed(tag)
                lease.gen = answered[0].gen
        for t, r in zip(takes, results, strict=True):
            book.stats.takes += 1
            st = book.states.get(t.key)
            if r is None:
                book.tally.take("failed")
                if st is not None:
                    st.taking = False
                continue
            grant, value = r.granted, r.value
            if st is None:  # forgotten meanwhile (cannot happen while taking): give it back
                name = counter_name(t.key)
                if grant and name is not None:
                    near.setdefault(name.tag, []).append(Adjustment(t.key, -grant, t.expire_at_ms))
                continue
            st.taking = False
            st.seen = value
            st.drawn, st.since_ms, st.largest = 0, now, st.largest // 2 or st.largest
            if grant > 0:
                book.tally.take("granted")
                book.tally.units("taken", grant)
                st.units += grant
                st.tranche = tranche_size(t.held, grant, s.tranches, t.least)
                # what brings the open part up to one tranche is open at once (allowance.lua)
                st.closed += closed_of_grant(grant, st.tranche, t.opened)
                st.deadline_ms = now + s.ttl_ms
            elif share_of_room(t.limit, value, t.share_ppm) >= max(t.least, 1):
                book.tally.take("none")  # it holds its share already: not near the limit
                self.returns.trim(st, value, near)  # ... or more, the room having shrunk
            else:
                # near the limit: nothing taken, none asked for a while, and what is still
                # held goes back now
                book.tally.take("none")
                st.quiet_until_ms = now + s.ttl_ms
                if st.units > 0:
                    self.returns.release(st, st.units, near)
        self.returns.add(near)
        if near:
            await self.returns.flush()
