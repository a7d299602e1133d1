"""Settlement of the requests admitted from allowances: refunds go back into the allowances
and shortfalls are drawn from them; what does not fit goes to Redis as an ordinary settlement
of the same ledger.  A Redis-admitted request whose last stream charge was drawn here gets that
charge back into the allowance when the gateway never confirmed it."""

from __future__ import annotations

import dataclasses

from extproc.core.keys import EXPIRY_SLACK_MS
from extproc.core.rules import Adjustment, UnconfirmedCharge
from extproc.limiter.allowance.drafts import DraftFlusher
from extproc.limiter.allowance.state import MAX_SETTLED, AllowanceBackend, Book
from extproc.limiter.base import SettleCall


class Settler:
    """Settling locally admitted requests (and the local charges of Redis-admitted ones)."""

    def __init__(self, book: Book, backend: AllowanceBackend, drafts: DraftFlusher) -> None:
        self.book = book
        self.backend = backend
        self.drafts = drafts

    def _settle_local(self, call: SettleCall) -> tuple[bool, SettleCall | None]:
        """Settle a locally admitted request here: (applied, what must still go to Redis)."""
        loc = self.book.ledgers.get(call.ledger)
        if loc is None:
            return False, None
        if loc.settled:
            return False, loc.remainder
        loc.settled = True
        self.drafts.done(call.ledger, loc)
        now = self.book.clock.now_ms()
        to_redis: list[Adjustment] = []
        unconfirmed: UnconfirmedCharge | None = call.unconfirmed
        if unconfirmed is not None and unconfirmed.seq == loc.last_local[0]:
            # drawn here, its answer not waited for: the corrections were computed without it
            for key, units in loc.last_local[1]:
                self._put_back(key, units, now, to_redis)
            unconfirmed = None
        elif unconfirmed is not None and unconfirmed.seq > loc.redis_seq:
            unconfirmed = None  # never sent: nothing to take back
        for a in call.adjustments:
            if a.amount < 0:
                self._put_back(a.key, -a.amount, now, to_redis, a.expire_at_ms)
            elif a.amount > 0:
                st = self.book.states.get(a.key)
                if st is not None and now < st.deadline_ms and st.units - st.closed >= a.amount:
                    st.units -= a.amount
                else:
                    to_redis.append(a)
        self.book.stats.local_settlements += 1
        self.book.tally.saved("settle")
        if to_redis or unconfirmed is not None:
            loc.remainder = SettleCall(
                call.ledger, to_redis, call.ledger_ttl_ms, unconfirmed=unconfirmed
            )
        else:
            self._forget(call.ledger)
        return True, loc.remainder

    def _settle_mixed(self, call: SettleCall) -> SettleCall:
        """The settlement of a Redis-admitted request whose last charge was drawn here and not
        confirmed to the gateway: its units go back into the allowance (the corrections were
        computed without it), and Redis, which never saw that charge, takes nothing back."""
        mix = self.book.mixed.pop(call.ledger, None)
        if mix is None:
            return call
        d = self.book.drafts.get(mix.tag)
        if d is not None:
            d.charged_more.pop(call.ledger, None)  # settled: no reclaim will bill it
        u = call.unconfirmed
        if u is None or u.seq != mix.last_local[0]:
            return call
        now = self.book.clock.now_ms()
        extra: list[Adjustment] = []
        for key, units in mix.last_local[1]:
            self._put_back(key, units, now, extra)
        return dataclasses.replace(call, adjustments=[*call.adjustments, *extra], unconfirmed=None)

    def _put_back(
        self, key: str, units: int, now: int, to_redis: list[Adjustment], expire_at: int = 0
    ) -> None:
        """A refund into the key's allowance (its window still running), else to Redis."""
        st = self.book.states.get(key)
        if st is not None and now + EXPIRY_SLACK_MS < st.expire_at_ms:
            st.units += units  # past its time, the sweeper gives it back on its next turn
        else:
            to_redis.append(Adjustment(key, -units, expire_at or (st.expire_at_ms if st else 0)))

    def _forget(self, ledger: str) -> None:
        book = self.book
        book.ledgers.pop(ledger, None)
        book.settled[ledger] = None
        if len(book.settled) > MAX_SETTLED:
            book.settled.popitem(last=False)

    def _remainder_done(self, ledger: str) -> None:
        loc = self.book.ledgers.get(ledger)
        if loc is not None:
            loc.remainder = None
            self._forget(ledger)

    async def settle(
        self,
        ledger: str,
        adjustments: list[Adjustment],
        *,
        ledger_ttl_ms: int,
        cancel: bool = False,
        unconfirmed: UnconfirmedCharge | None = None,
    ) -> bool:
        """Settle a locally admitted request into the allowances (what does not fit goes to
        Redis); any other with the wrapped limiter."""
        if ledger in self.book.settled:
            return False
        if ledger not in self.book.ledgers:
            call = self._settle_mixed(
                SettleCall(ledger, adjustments, ledger_ttl_ms, cancel, unconfirmed)
            )
            return await self.backend.settle(
                ledger,
                call.adjustments,
                ledger_ttl_ms=ledger_ttl_ms,
                cancel=cancel,
                unconfirmed=call.unconfirmed,
            )
        applied, rest = self._settle_local(
            SettleCall(ledger, adjustments, ledger_ttl_ms, cancel, unconfirmed)
        )
        if rest is not None:
            await self.backend.settle(
                rest.ledger,
                rest.adjustments,
                ledger_ttl_ms=rest.ledger_ttl_ms,
                unconfirmed=rest.unconfirmed,
            )
            self._remainder_done(ledger)
            return True
        return applied

    async def settle_many(self, items: list[SettleCall]) -> list[bool | None]:
        """:meth:`settle` for many; the Redis parts in the wrapped limiter's batch calls."""
        out: list[bool | None] = [None] * len(items)
        remote: list[SettleCall] = []
        where: list[tuple[int, bool]] = []  # (item index, a local request's remainder)
        for i, call in enumerate(items):
            if call.ledger in self.book.settled:
                out[i] = False
                continue
            if call.ledger not in self.book.ledgers:
                remote.append(self._settle_mixed(call))
                where.append((i, False))
                continue
            applied, rest = self._settle_local(call)
            if rest is None:
                out[i] = applied
            else:
                remote.append(rest)
                where.append((i, True))
        if remote:
            results = await self.backend.settle_many(remote)
            for (i, is_rest), r in zip(where, results, strict=True):
                if is_rest:
                    if r is not None:
                        self._remainder_done(items[i].ledger)
                        out[i] = True
                else:
                    out[i] = r
        return out
