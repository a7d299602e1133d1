""":class:`AllowanceLimiter`: the limiter protocol around another limiter, admitting, charging
and settling from the allowances when they hold enough (all or nothing), else with the wrapped
limiter."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Sequence

import structlog

from extproc.core.keys import counter_name
from extproc.core.rules import Adjustment, BucketCharge, UnconfirmedCharge
from extproc.limiter.allowance.drafts import Drafting
from extproc.limiter.allowance.state import MAX_LEDGERS, MAX_SETTLED, Bucket, Local
from extproc.limiter.allowance.taking import Taking
from extproc.limiter.base import (
    AdmitResult,
    ChargeResult,
    InputNote,
    Reclaimed,
    SettleCall,
)

log = structlog.get_logger("extproc")


class AllowanceLimiter(Taking, Drafting):
    """:class:`extproc.limiter.base.Limiter` around another limiter, with local allowances."""

    @property
    def round_trips(self) -> int:
        """The wrapped limiter's script calls."""
        return int(getattr(self.inner, "round_trips", 0))

    def configure(self, **kwargs: object) -> None:
        """Pass failure settings to the wrapped limiter (SIGHUP reload)."""
        configure = getattr(self.inner, "configure", None)
        if configure is not None:
            configure(**kwargs)

    async def ping(self) -> bool:
        """Whether the backend answers."""
        return await self.inner.ping()

    async def read(self, keys: list[str]) -> list[int]:
        """Counter values: allowances held by any replica count as used (net of them)."""
        return await self.inner.read(keys)

    async def count_slots(self, keys: list[str], now_ms: int) -> list[int]:
        """Live concurrency slots (never held in allowances)."""
        return await self.inner.count_slots(keys, now_ms)

    def _eligible(self, c: BucketCharge) -> bool:
        if c.kind not in ("rpm", "tpm") or c.shadow or c.prev_key:
            return False
        name = counter_name(c.key)
        return (
            name is not None
            and name.metric in ("rpm", "tpm")
            and name.window_s <= self.settings.max_window_s
        )

    def _plan(self, buckets: Sequence[BucketCharge], now: int) -> list[Bucket] | None:
        """Each bucket's state when every one can be drawn from for its amount, else None."""
        out: list[Bucket] = []
        for c in buckets:
            st = self._states.get(c.key)
            if (
                st is None
                or not self._eligible(c)
                or now >= st.deadline_ms
                or st.units - st.closed < c.amount
            ):
                return None
            out.append(st)
        return out

    def _values(self, buckets: Sequence[BucketCharge], plan: list[Bucket]) -> tuple[int, ...]:
        # the counter as last answered: it already includes every allowance (held = used)
        return tuple(max(st.seen, 0) for st in plan)

    async def admit(
        self,
        ledger: str,
        buckets: list[BucketCharge],
        *,
        tpm_charged: int,
        count_refused: bool,
        ledger_ttl_ms: int,
        now_ms: int = 0,
        lease_until_ms: int = 0,
        record_draft: str = "",
        settlements: Sequence[SettleCall] = (),
    ) -> AdmitResult:
        """Admit from the allowances when every bucket holds enough (no Redis call), else
        with the wrapped limiter, the rest of a short allowance riding on the call."""
        now = self.clock.now_ms()
        self._start_sweeper()
        local = all(self._eligible(c) for c in buckets) and bool(buckets)
        if local:
            self._observe(buckets, now)
        plan = self._plan(buckets, now) if local and not settlements else None
        if plan is not None:
            for c, st in zip(buckets, plan, strict=True):
                st.units -= c.amount
            if len(self._ledgers) >= MAX_LEDGERS:
                # the oldest (a request never settled: modes that settle nothing): forgotten,
                # its later calls, if any, go to Redis, which counts them right all the same
                self._draft_done(*self._ledgers.popitem(last=False))
            loc = self._ledgers[ledger] = Local(tag=plan[0].tag, charged=tpm_charged)
            if record_draft and self._keeps_drafts:
                loc.draft = record_draft
                d = self._draft_ledger(loc.tag)
                d.open[ledger] = None
                d.ttl_ms = max(d.ttl_ms, ledger_ttl_ms)
                d.touch(now)
            self.stats.local_admissions += 1
            self._saved("admit")
            self._refill(buckets, now)
            self._open_ahead(plan)
            return AdmitResult(
                admitted=True,
                duplicate=False,
                values=self._values(buckets, plan),
                reclaimed=self._take_reclaimed(),
            )
        riders = list(settlements)
        if local:
            self._open_short(buckets)
        back = self._give_back_short(buckets, now) if local else None
        if back is not None:
            riders.append(back)
        try:
            res = await self.inner.admit(
                ledger,
                buckets,
                tpm_charged=tpm_charged,
                count_refused=count_refused,
                ledger_ttl_ms=ledger_ttl_ms,
                now_ms=now_ms,
                lease_until_ms=lease_until_ms,
                record_draft=record_draft,
                settlements=riders,
            )
        except BaseException:
            if back is not None:
                self._returns.append(back)  # idempotent by its ledger: sent again later
            raise
        if back is not None:
            self._count("returned", -sum(a.amount for a in back.adjustments))
        if res.allowance_reclaimed:
            self._count("reclaimed", res.allowance_reclaimed)
        if local:
            self._saw(buckets, res.values)
            if res.admitted:
                self._refill(buckets, now)
        if len(riders) != len(settlements) or self._reclaimed:
            res = dataclasses.replace(
                res,
                reclaimed=res.reclaimed + self._take_reclaimed(),
                settled=res.settled[: len(settlements)],
            )
        return res

    def _take_reclaimed(self) -> tuple[Reclaimed, ...]:
        out, self._reclaimed = tuple(self._reclaimed), []
        return out

    async def charge(
        self,
        ledger: str,
        seq: int,
        buckets: list[BucketCharge],
        amount: int,
        *,
        strict: bool,
        ledger_ttl_ms: int,
    ) -> ChargeResult:
        """Draw a locally admitted request's charge from the allowances when they hold it,
        else charge in Redis (strict or lazy, as the wrapped limiter does)."""
        loc = self._ledgers.get(ledger)
        now = self.clock.now_ms()
        if buckets and all(self._eligible(c) for c in buckets):
            self._observe(buckets, now, admission=False)  # the demand sizing follows
            self._refill(buckets, now)
        if loc is None and ledger not in self._settled:
            return await self._charge_mixed(
                ledger, seq, buckets, amount, strict=strict, ledger_ttl_ms=ledger_ttl_ms
            )
        if loc is not None and not loc.settled:
            if seq <= loc.seq and seq == loc.last_local[0]:
                return ChargeResult(granted=amount, exhausted=False, values=())
            plan = self._plan(buckets, now) if seq > loc.seq else None
            if plan is not None:
                drawn = []
                for c, st in zip(buckets, plan, strict=True):
                    st.units -= c.amount
                    drawn.append((st.key, c.amount))
                loc.seq = seq
                loc.last_local = (seq, tuple(drawn))
                loc.charged += amount
                self.stats.local_charges += 1
                self._saved("charge")
                self._open_ahead(plan)
                return ChargeResult(
                    granted=amount, exhausted=False, values=self._values(buckets, plan)
                )
            if seq > loc.seq:
                self._open_short(buckets)
            res = await self.inner.charge(
                ledger, seq, buckets, amount, strict=strict, ledger_ttl_ms=ledger_ttl_ms
            )
            if seq > loc.seq:
                loc.charged += res.granted
            loc.seq = max(loc.seq, seq)
            loc.redis_seq = max(loc.redis_seq, seq)
            self._saw(buckets, res.values)
            return res
        return await self.inner.charge(
            ledger, seq, buckets, amount, strict=strict, ledger_ttl_ms=ledger_ttl_ms
        )

    async def _charge_mixed(
        self,
        ledger: str,
        seq: int,
        buckets: list[BucketCharge],
        amount: int,
        *,
        strict: bool,
        ledger_ttl_ms: int,
    ) -> ChargeResult:
        """A charge of a request Redis admitted: drawn from the allowances when they hold it
        (its ledger stays in Redis: the settlement's corrections go there as usual, counted
        against what the gateway was granted, local draws included), else charged in Redis."""
        mix = self._mixed.get(ledger)
        if mix is not None and seq <= mix.seq and seq == mix.last_local[0]:
            return ChargeResult(granted=amount, exhausted=False, values=())  # a retry
        now = self.clock.now_ms()
        plan = self._plan(buckets, now) if buckets and (mix is None or seq > mix.seq) else None
        if plan is not None:
            if mix is None:
                if len(self._mixed) >= MAX_LEDGERS:
                    self._mixed.popitem(last=False)  # a request never settled: forgotten
                mix = self._mixed[ledger] = Local(tag=plan[0].tag)
            drawn = []
            for c, st in zip(buckets, plan, strict=True):
                st.units -= c.amount
                drawn.append((st.key, c.amount))
            mix.seq = seq
            mix.last_local = (seq, tuple(drawn))
            if self._keeps_drafts:
                # not in its ledger's "charged" (what a reclaim bills): a later flush adds it
                d = self._draft_ledger(mix.tag)
                if not d.charged_more:
                    d.more_since_ms = now
                d.charged_more[ledger] = d.charged_more.get(ledger, 0) + amount
            self.stats.local_charges += 1
            self._saved("charge")
            self._open_ahead(plan)
            return ChargeResult(granted=amount, exhausted=False, values=self._values(buckets, plan))
        if buckets and all(self._eligible(c) for c in buckets):
            self._open_short(buckets)
        res = await self.inner.charge(
            ledger, seq, buckets, amount, strict=strict, ledger_ttl_ms=ledger_ttl_ms
        )
        if mix is not None:
            mix.seq = max(mix.seq, seq)
            mix.redis_seq = max(mix.redis_seq, seq)
        if buckets and all(self._eligible(c) for c in buckets):
            self._saw(buckets, res.values)
        return res

    def _settle_mixed(self, call: SettleCall) -> SettleCall:
        """The settlement of a Redis-admitted request whose last charge was drawn here and not
        confirmed to the gateway: its units go back into the allowance (the corrections were
        computed without it), and Redis, which never saw that charge, takes nothing back."""
        mix = self._mixed.pop(call.ledger, None)
        if mix is None:
            return call
        d = self._drafts.get(mix.tag)
        if d is not None:
            d.charged_more.pop(call.ledger, None)  # settled: no reclaim will bill it
        u = call.unconfirmed
        if u is None or u.seq != mix.last_local[0]:
            return call
        now = self.clock.now_ms()
        extra: list[Adjustment] = []
        for key, units in mix.last_local[1]:
            self._put_back(key, units, now, extra)
        return dataclasses.replace(call, adjustments=[*call.adjustments, *extra], unconfirmed=None)

    def _settle_local(self, call: SettleCall) -> tuple[bool, SettleCall | None]:
        """Settle a locally admitted request here: (applied, what must still go to Redis)."""
        loc = self._ledgers.get(call.ledger)
        if loc is None:
            return False, None
        if loc.settled:
            return False, loc.remainder
        loc.settled = True
        self._draft_done(call.ledger, loc)
        now = self.clock.now_ms()
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
                st = self._states.get(a.key)
                if st is not None and now < st.deadline_ms and st.units - st.closed >= a.amount:
                    st.units -= a.amount
                else:
                    to_redis.append(a)
        self.stats.local_settlements += 1
        self._saved("settle")
        if to_redis or unconfirmed is not None:
            loc.remainder = SettleCall(
                call.ledger, to_redis, call.ledger_ttl_ms, unconfirmed=unconfirmed
            )
        else:
            self._forget(call.ledger)
        return True, loc.remainder

    def _forget(self, ledger: str) -> None:
        self._ledgers.pop(ledger, None)
        self._settled[ledger] = None
        if len(self._settled) > MAX_SETTLED:
            self._settled.popitem(last=False)

    def _remainder_done(self, ledger: str) -> None:
        loc = self._ledgers.get(ledger)
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
        if ledger in self._settled:
            return False
        if ledger not in self._ledgers:
            call = self._settle_mixed(
                SettleCall(ledger, adjustments, ledger_ttl_ms, cancel, unconfirmed)
            )
            return await self.inner.settle(
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
            await self.inner.settle(
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
            if call.ledger in self._settled:
                out[i] = False
                continue
            if call.ledger not in self._ledgers:
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
            results = await self.inner.settle_many(remote)
            for (i, is_rest), r in zip(where, results, strict=True):
                if is_rest:
                    if r is not None:
                        self._remainder_done(items[i].ledger)
                        out[i] = True
                else:
                    out[i] = r
        return out

    async def note_inputs(self, notes: list[InputNote]) -> list[bool | None]:
        """Locally admitted requests have no ledger in Redis to note (False); the others go
        to the wrapped limiter."""
        out: list[bool | None] = [False] * len(notes)
        remote = [i for i, n in enumerate(notes) if n.ledger not in self._ledgers]
        noter = getattr(self.inner, "note_inputs", None)
        if remote and noter is not None:
            results = await noter([notes[i] for i in remote])
            for i, r in zip(remote, results, strict=True):
                out[i] = r
        return out

    async def renew(
        self, ledgers: list[str], until_ms: int, *, held: dict[str, list[str]] | None = None
    ) -> None:
        """Renew the leases of the requests admitted by Redis (local ones hold none) and of
        this replica's allowance ledgers that record never-opened units."""
        remote = [led for led in ledgers if led not in self._ledgers]
        tags = {st.tag for st in self._states.values() if st.closed or st.releasing}
        leases = [self._leases[t] for t in tags if t in self._leases and self._leases[t].gen]
        remote += [lease.ledger for lease in leases]
        if remote:
            await self.inner.renew(remote, until_ms, held=held)
            now = self.clock.now_ms()
            for lease in leases:
                lease.renewed_ms = now

    def _start_sweeper(self) -> None:
        if self._sweeper is None and not self._closed:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.create_task(self._sweep_loop())
            self._draft_task = loop.create_task(self._draft_loop())

    async def close(self) -> None:
        """Give back what is held (best effort), stop the background tasks, close the
        wrapped limiter."""
        self._closed = True
        for task in (self._sweeper, self._draft_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.give_back(), timeout=2.0)
        with contextlib.suppress(Exception):
            # drafts of requests settled since the last flush leave the draft ledgers (those
            # still open stay: if this process never settles them, the reclaim records them)
            await asyncio.wait_for(self.flush_drafts(force=True), timeout=2.0)
        log.info(
            "allowances_closed", **dataclasses.asdict(self.stats), unreturned=self._unreturned()
        )
        await self.inner.close()
