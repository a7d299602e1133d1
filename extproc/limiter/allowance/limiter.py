""":class:`AllowanceLimiter`: the limiter protocol around another limiter, admitting and
charging from the allowances when every bucket holds enough (all or nothing), else with the
wrapped limiter.  It holds the :class:`.state.Book` and the parts that work on it (each
given the book and the wrapped limiter): the :class:`.taking.Taker`, the
:class:`.returns.Returns`, the :class:`.tranches.Tranches`, the :class:`.drafts.DraftFlusher`
and the :class:`.settling.Settler`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from extproc.clock import Clock, SystemClock
from extproc.core.keys import counter_name
from extproc.core.rules import Adjustment, BucketCharge, UnconfirmedCharge
from extproc.errors import LimiterUnavailable
from extproc.limiter.allowance.drafts import DraftFlusher
from extproc.limiter.allowance.returns import Returns
from extproc.limiter.allowance.settling import Settler
from extproc.limiter.allowance.state import (
    MAX_LEDGERS,
    AllowanceBackend,
    AllowanceSettings,
    Book,
    Bucket,
    Local,
)
from extproc.limiter.allowance.stats import AllowanceStats
from extproc.limiter.allowance.taking import Taker
from extproc.limiter.allowance.tranches import Tranches
from extproc.limiter.base import (
    AdmitCall,
    AdmitResult,
    ChargeResult,
    InputNote,
    Reclaimed,
    SettleCall,
)

if TYPE_CHECKING:
    from extproc.metrics import Metrics

log = structlog.get_logger("extproc")


class AllowanceLimiter:
    """:class:`extproc.limiter.base.Limiter` around another limiter, with local allowances."""

    def __init__(
        self,
        inner: AllowanceBackend,
        settings: AllowanceSettings | None = None,
        *,
        clock: Clock | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.inner = inner
        self.settings = settings or AllowanceSettings()
        self.clock: Clock = clock or SystemClock()
        self.metrics = metrics
        book = self.book = Book(
            self.settings, self.clock, metrics=metrics, keeps_drafts=hasattr(inner, "keep_drafts")
        )
        # the tranches hand what they opened to be given back to the returns, built after them
        self.tranches = Tranches(book, inner, lambda back: self.returns.queue(back))  # noqa: PLW0108
        self.returns = Returns(book, inner, self.tranches)
        self.taker = Taker(book, inner, self.tranches, self.returns)
        self.drafts = DraftFlusher(book, inner)
        self.settler = Settler(book, inner, self.drafts)
        self._sweeper: asyncio.Task[None] | None = None
        self._draft_task: asyncio.Task[None] | None = None

    @property
    def stats(self) -> AllowanceStats:
        """What the wrapper did (tests and the bench read it; the metrics export the same)."""
        return self.book.stats

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
        """Counter values (the usage API's ``used``) net of what this replica holds: units
        pre-debited for it and not drawn (being given back included) were used by no request.
        Other replicas' allowances stay in (this one cannot know what they drew).  What this
        replica held both before and after the read is taken off (the smaller of the two per
        counter): a take answered meanwhile, or a give-back sent meanwhile, may leave the value
        above the requests' use for that moment, never below it."""
        before = self.held()
        values = await self.inner.read(keys)
        after = self.held()
        return [
            max(v - min(before.get(k, 0), after.get(k, 0)), 0)
            for k, v in zip(keys, values, strict=True)
        ]

    def held(self) -> dict[str, int]:
        """Units this replica holds pre-debited in Redis and not drawn, by counter key: its
        allowances (never-opened tranches included), never-opened units being given back,
        and give-backs queued but not sent (one being sent is left out: its refund may have
        reached the counter already)."""
        out: dict[str, int] = {}
        for key, st in self.book.states.items():
            if st.units or st.releasing:
                out[key] = st.units + st.releasing
        for call in self.book.returns:
            for a in call.adjustments:
                if a.amount < 0:
                    out[a.key] = out.get(a.key, 0) - a.amount
        return out

    async def count_slots(self, keys: list[str], now_ms: int) -> list[int]:
        """Live concurrency slots (never held in allowances)."""
        return await self.inner.count_slots(keys, now_ms)

    async def count_members(self, keys: list[str]) -> list[int]:
        """A team's distinct end users (never held in allowances)."""
        return await self.inner.count_members(keys)

    def _eligible(self, c: BucketCharge) -> bool:
        if c.kind not in ("rpm", "tpm") or c.shadow or c.prev_key:
            return False
        name = counter_name(c.key)
        return (
            name is not None
            and name.metric in ("rpm", "tpm")
            # a calendar month's key names no length (window_s 0): judged at its longest
            and name.longest_s <= self.settings.max_window_s
        )

    def _plan(
        self, buckets: Sequence[BucketCharge], now: int, *, eligible: bool = False
    ) -> list[Bucket] | None:
        """Each bucket's state when every one can be drawn from for its amount, else None
        (``eligible``: the caller has checked :meth:`_eligible` of every bucket already)."""
        out: list[Bucket] = []
        states = self.book.states
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

    async def admit(self, call: AdmitCall) -> AdmitResult:
        """Admit from the allowances when every bucket holds enough (no Redis call), else
        with the wrapped limiter, the rest of a short allowance riding on the call."""
        ledger, buckets, settlements = call.ledger, call.buckets, call.settlements
        now = self.clock.now_ms()
        self._start_sweeper()
        # a request that may wait goes to Redis: its tenant's queue decides (waiters first)
        local = all(self._eligible(c) for c in buckets) and bool(buckets) and call.queue is None
        if local:
            self.taker.observe(buckets, now)
        plan = self._plan(buckets, now, eligible=True) if local and not settlements else None
        if plan is not None:
            for c, st in zip(buckets, plan, strict=True):
                st.units -= c.amount
            book = self.book
            if len(book.ledgers) >= MAX_LEDGERS:
                # the oldest (a request never settled: modes that settle nothing): forgotten,
                # its later calls, if any, go to Redis, which counts them right all the same
                self.drafts.done(*book.ledgers.popitem(last=False))
            loc = book.ledgers[ledger] = Local(tag=plan[0].tag, charged=call.tpm_charged)
            if call.record_draft and book.keeps_drafts:
                loc.draft = call.record_draft
                d = self.drafts.ledger(loc.tag)
                d.open[ledger] = None
                d.wait(ledger, now)
                d.ttl_ms = max(d.ttl_ms, call.ledger_ttl_ms)
            book.stats.local_admissions += 1
            book.tally.saved("admit")
            self.taker.refill(buckets, now)
            self.tranches.open_ahead(plan)
            return AdmitResult(
                admitted=True,
                duplicate=False,
                values=self._values(buckets, plan),
                reclaimed=self._take_reclaimed(),
            )
        riders = list(settlements)
        if local:
            self.tranches.open_short(buckets)
        back = self.returns.give_back_short(buckets, now) if local else None
        if back is not None:
            riders.append(back)
        try:
            res = await self.inner.admit(
                call if back is None else call._replace(settlements=riders)
            )
        except BaseException:
            if back is not None:
                self.book.returns.append(back)  # idempotent by its ledger: sent again later
            raise
        tally = self.book.tally
        if back is not None:
            tally.units("returned", -sum(a.amount for a in back.adjustments))
        if res.allowance_reclaimed:
            tally.units("reclaimed", res.allowance_reclaimed)
        if local:
            self.taker.saw(buckets, res.values)
            if res.admitted:
                self.taker.refill(buckets, now)
        if len(riders) != len(settlements) or self.book.reclaimed:
            res = dataclasses.replace(
                res,
                reclaimed=res.reclaimed + self._take_reclaimed(),
                settled=res.settled[: len(settlements)],
            )
        return res

    def _take_reclaimed(self) -> tuple[Reclaimed, ...]:
        out, self.book.reclaimed = tuple(self.book.reclaimed), []
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
        loc = self.book.ledgers.get(ledger)
        now = self.clock.now_ms()
        if buckets and all(self._eligible(c) for c in buckets):
            self.taker.observe(buckets, now, admission=False)  # the demand sizing follows
            self.taker.refill(buckets, now)
        if loc is None and ledger not in self.book.settled:
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
                self.tranches.open_short(buckets)
            res = await self.inner.charge(
                ledger, seq, buckets, amount, strict=strict, ledger_ttl_ms=ledger_ttl_ms
            )
            if seq > loc.seq:
                loc.charged += res.granted
            loc.seq = max(loc.seq, seq)
            loc.redis_seq = max(loc.redis_seq, seq)
            self.taker.saw(buckets, res.values)
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
        self.book.stats.local_charges += 1
        self.book.tally.saved("charge")
        self.tranches.open_ahead(plan)
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
        book = self.book
        mix = book.mixed.get(ledger)
        if mix is not None and seq <= mix.seq and seq == mix.last_local[0]:
            return ChargeResult(granted=amount, exhausted=False, values=())  # a retry
        now = self.clock.now_ms()
        plan = self._plan(buckets, now) if buckets and (mix is None or seq > mix.seq) else None
        if plan is not None:
            if mix is None:
                if len(book.mixed) >= MAX_LEDGERS:
                    book.mixed.popitem(last=False)  # a request never settled: forgotten
                mix = book.mixed[ledger] = Local(tag=plan[0].tag)
            if book.keeps_drafts:
                # not in its ledger's "charged" (what a reclaim bills): a later flush adds it
                d = self.drafts.ledger(mix.tag)
                if not d.charged_more:
                    d.more_since_ms = now
                d.charged_more[ledger] = d.charged_more.get(ledger, 0) + amount
            return self._draw_charge(mix, seq, buckets, plan, amount)
        if buckets and all(self._eligible(c) for c in buckets):
            self.tranches.open_short(buckets)
        res = await self.inner.charge(
            ledger, seq, buckets, amount, strict=strict, ledger_ttl_ms=ledger_ttl_ms
        )
        if mix is not None:
            mix.seq = max(mix.seq, seq)
            mix.redis_seq = max(mix.redis_seq, seq)
        if buckets and all(self._eligible(c) for c in buckets):
            self.taker.saw(buckets, res.values)
        return res

    async def note_inputs(self, notes: list[InputNote]) -> list[bool | None]:
        """Locally admitted requests have no ledger in Redis to note (False); the others go
        to the wrapped limiter."""
        out: list[bool | None] = [False] * len(notes)
        remote = [i for i, n in enumerate(notes) if n.ledger not in self.book.ledgers]
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

    async def leave_queue(self, ledger: str, keys: tuple[str, str, str]) -> bool:
        """The wrapped limiter's (queues live in Redis)."""
        return await self.inner.leave_queue(ledger, keys)

    async def renew(
        self, ledgers: list[str], until_ms: int, *, held: dict[str, list[str]] | None = None
    ) -> None:
        """Renew the leases of the requests admitted by Redis (local ones hold none) and of
        this replica's allowance ledgers that record never-opened units."""
        book = self.book
        remote = [led for led in ledgers if led not in book.ledgers]
        tags = {st.tag for st in book.states.values() if st.closed or st.releasing}
        leases = [book.leases[t] for t in tags if t in book.leases and book.leases[t].gen]
        remote += [lease.ledger for lease in leases]
        if remote:
            await self.inner.renew(remote, until_ms, held=held)
            now = self.clock.now_ms()
            for lease in leases:
                lease.renewed_ms = now

    def settle(
        self,
        ledger: str,
        adjustments: list[Adjustment],
        *,
        ledger_ttl_ms: int,
        cancel: bool = False,
        unconfirmed: UnconfirmedCharge | None = None,
    ) -> Coroutine[Any, Any, bool]:
        """Settle a locally admitted request into the allowances (what does not fit goes to
        Redis); any other with the wrapped limiter (:class:`.settling.Settler`)."""
        return self.settler.settle(
            ledger, adjustments, ledger_ttl_ms=ledger_ttl_ms, cancel=cancel, unconfirmed=unconfirmed
        )

    def settle_many(self, items: list[SettleCall]) -> Coroutine[Any, Any, list[bool | None]]:
        """:meth:`settle` for many; the Redis parts in the wrapped limiter's batch calls."""
        return self.settler.settle_many(items)

    def sweep(self) -> None:
        """Give back what allowances past their time hold (:meth:`.returns.Returns.sweep`)."""
        self.returns.sweep()

    async def give_back(self) -> None:
        """Give back everything held now (shutdown; tests), once the takes and openings in
        flight are answered (a grant answered after would be held again, until its time)."""
        if self.book.tasks:
            await asyncio.wait(list(self.book.tasks), timeout=2.0)
        await self.returns.give_back()

    async def flush_drafts(self, *, force: bool = False) -> None:
        """Send the draft ledgers' due changes now (:meth:`.drafts.DraftFlusher.flush`)."""
        await self.drafts.flush(force=force)

    def _start_sweeper(self) -> None:
        if self._sweeper is None and not self.book.closed:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.create_task(self.returns.sweep_loop())
            self._draft_task = loop.create_task(self.drafts.loop())

    async def close(self) -> None:
        """Give back what is held (best effort), stop the background tasks, close the
        wrapped limiter."""
        self.book.closed = True
        for task in (self._sweeper, self._draft_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.book.tasks:
            await asyncio.wait(list(self.book.tasks), timeout=2.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.give_back(), timeout=2.0)
        with contextlib.suppress(Exception):
            # drafts of requests settled since the last flush leave the draft ledgers (those
            # still open stay: if this process never settles them, the reclaim records them)
            await asyncio.wait_for(self.flush_drafts(force=True), timeout=2.0)
        log.info(
            "allowances_closed",
            **dataclasses.asdict(self.stats),
            unreturned=self.returns.unreturned(),
        )
        await self.inner.close()
