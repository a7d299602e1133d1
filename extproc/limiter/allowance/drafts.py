"""The usage-record drafts of requests admitted from allowances: kept, batched, in the
replica's draft ledger for the tenant (``drafts.lua``), one call a tenant every
``draft_flush_ms``."""

from __future__ import annotations

import asyncio

from extproc.limiter.allowance.state import AllowanceBackend, Book, Drafts, Local


class DraftFlusher:
    """The draft ledgers and their flushes."""

    def __init__(self, book: Book, backend: AllowanceBackend) -> None:
        self.book = book
        self.backend = backend

    def ledger(self, tag: str) -> Drafts:
        """The tenant's draft ledger on this replica (a new one when it has none)."""
        d = self.book.drafts.get(tag)
        if d is None:
            d = self.book.drafts[tag] = Drafts(f"{tag}:req:drafts.{self.book.instance}")
        return d

    def done(self, ledger: str, loc: Local) -> None:
        """A local request settled (or forgotten): its draft leaves the draft ledger (by the
        next flush, if it was sent)."""
        if not loc.draft:
            return
        d = self.book.drafts.get(loc.tag)
        if d is None:
            return
        d.open.pop(ledger, None)
        d.waiting.pop(ledger, None)
        if d.sent.pop(ledger, None) is not None:
            d.drops.append(ledger)
            d.touch(self.book.clock.now_ms())

    async def loop(self) -> None:
        """Flush what is due, forever."""
        tick = min(max(self.book.settings.draft_flush_ms, 1), 100) / 2000
        while True:
            await asyncio.sleep(tick)
            await self.flush()

    async def flush(self, *, force: bool = False) -> None:
        """Send each tenant's drafts once the oldest of them still waiting waited
        ``draft_flush_ms`` (a request settled sooner costs nothing, whatever the others do),
        with the drops and the charged figures (one call a tenant, which sends every draft and
        drop then waiting: at most one call a tenant every ``draft_flush_ms``); drops alone
        after a third of the lease; renew the draft ledgers still holding drafts every third
        of the lease."""
        book = self.book
        now = book.clock.now_ms()
        third = book.settings.lease_ms // 3
        wait = 0 if force else book.settings.draft_flush_ms
        # a drop alone waits for a third of the lease (it rides on any call before): the
        # drafts sent with a call are often settled soon after, and their drops must not make
        # the next call, which would send the drafts then waiting, and so on
        later = 0 if force else max(wait, third)
        due = []
        for d in book.drafts.values():
            if d.flushing:
                continue
            oldest = next(iter(d.waiting.values()), None)  # since when the oldest waits
            changes = (oldest is not None and now - oldest >= wait) or (
                d.pending_ms and now - d.pending_ms >= later
            )
            if (
                (changes and (force or now >= d.retry_ms))
                or (d.sent and (force or now - d.renewed_ms >= third))
                or (d.charged_more and (force or now - d.more_since_ms >= third))
            ):
                due.append(d)
        if due:
            await asyncio.gather(*(self._flush(d) for d in due))
        for tag, d in list(book.drafts.items()):
            if not (d.open or d.sent or d.drops or d.charged_more or d.flushing):
                del book.drafts[tag]

    async def _flush(self, d: Drafts) -> None:
        keeper = getattr(self.backend, "keep_drafts", None)
        if keeper is None:
            return
        d.flushing = True
        try:
            before = set(d.sent)
            waiting, d.waiting = d.waiting, {}
            keep = [
                (led, loc.charged, loc.draft)
                for led in waiting
                if (loc := self.book.ledgers.get(led)) is not None
            ]
            charged = [
                (led, loc.charged)
                for led, c in d.sent.items()
                if (loc := self.book.ledgers.get(led)) is not None and loc.charged != c
            ]
            drops, d.drops = d.drops, []
            more, d.charged_more = d.charged_more, {}
            d.pending_ms = 0
            now = self.book.clock.now_ms()
            s = self.book.settings
            try:
                ok: bool | None = await keeper(
                    d.ledger,
                    now + s.lease_ms,
                    d.ttl_ms + s.lease_ms,
                    keep=keep,
                    charged=charged,
                    drop=drops,
                    more=list(more.items()),
                )
            except Exception:
                ok = None
            self.book.stats.draft_calls += 1
            if ok is None:  # sent again at the next flush, one interval on
                d.drops = drops + d.drops
                d.retry_ms = now + s.draft_flush_ms
                if d.drops:
                    d.touch(now - max(s.lease_ms // 3 - s.draft_flush_ms, 0))
                for led in waiting:
                    if led in d.open and led not in d.sent:
                        d.waiting[led] = waiting[led]
                d.waiting = dict(sorted(d.waiting.items(), key=lambda kv: kv[1]))
                for led, n in more.items():
                    d.charged_more[led] = d.charged_more.get(led, 0) + n
                return
            d.renewed_ms = now
            self.book.stats.drafts_sent += len(keep)
            for led, c in charged:
                if led in d.sent:
                    d.sent[led] = c
            if not ok and before:
                # created anew (reclaimed, lost): the drafts sent before go again
                for led in before:
                    if d.sent.pop(led, None) is not None:
                        d.wait(led, now)
            for led, c, _ in keep:
                if led in d.open:
                    d.sent[led] = c
                else:
                    d.drops.append(led)  # settled while this call was on its way
                    d.touch(now)
        finally:
            d.flushing = False
