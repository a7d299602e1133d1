""":class:`AllowanceLimiter`: the limiter protocol around another limiter, admitting and
charging from the allowances when every bucket holds enough (all or nothing), else with the
wrapped limiter; settling through :mod:`.settling`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Sequence

import structlog

from extproc.core.keys import counter_name
from extproc.core.rules import BucketCharge
from extproc.errors import LimiterUnavailable
from extproc.limiter.allowance.settling import Settling
from extproc.limiter.allowance.state import MAX_LEDGERS, Bucket, Local
from extproc.limiter.allowance.taking import Taking
from extproc.limiter.base import (
    AdmitResult,
    ChargeResult,
    InputNote,
    Reclaimed,
    SettleCall,
)

log = structlog.get_logger("extproc")


class AllowanceLimiter(Taking, Settling):
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

    def _plan(
        self, buckets: Sequence[BucketCharge], now: int, *, eligible: bool = False
    ) -> list[Bucket] | None:
        """Each bucket's state when every one can be drawn from for its amount, else None
        (``eligible``: the caller has checked :meth:`_eligible` of every bucket already)."""
        out: list[Bucket] = []
        states = self._states
        for c in buckets:
            st = states.get(c.key)
            if (
                st is None
                or not (eligible or self._eligible(c))
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
        plan = self._plan(buckets, now, eligible=True) if local and not settlements else None
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
                loc.charged += amount
                return self._draw_charge(loc, seq, buckets, plan, amount)
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

    def _draw_charge(
        self, loc: Local, seq: int, buckets: list[BucketCharge], plan: list[Bucket], amount: int
    ) -> ChargeResult:
        """Draw stream charge ``seq`` from the allowances ``plan`` found holding it: each
        bucket's units, the request's last local draw (what a retry of ``seq`` is answered
        from), the counts."""
        drawn = []
        for c, st in zip(buckets, plan, strict=True):
            st.units -= c.amount
            drawn.append((st.key, c.amount))
        loc.seq = seq
        loc.last_local = (seq, tuple(drawn))
        self.stats.local_charges += 1
        self._saved("charge")
        self._open_ahead(plan)
        return ChargeResult(granted=amount, exhausted=False, values=self._values(buckets, plan))

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
            if self._keeps_drafts:
                # not in its ledger's "charged" (what a reclaim bills): a later flush adds it
                d = self._draft_ledger(mix.tag)
                if not d.charged_more:
                    d.more_since_ms = now
                d.charged_more[ledger] = d.charged_more.get(ledger, 0) + amount
            return self._draw_charge(mix, seq, buckets, plan, amount)
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

    async def stop_input_shortcut(self, key: str, model: str, entry: str, ttl_ms: int) -> bool:
        """The wrapped limiter's (Redis): allowances change nothing here."""
        store = getattr(self.inner, "stop_input_shortcut", None)
        if store is None:
            raise LimiterUnavailable("the wrapped limiter keeps no input shortcut stops")
        return bool(await store(key, model, entry, ttl_ms))

    async def input_stops(self, key: str) -> list[str]:
        """The wrapped limiter's (Redis)."""
        read = getattr(self.inner, "input_stops", None)
        return list(await read(key)) if read is not None else []

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
