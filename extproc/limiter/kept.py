"""Settlements Redis did not take, kept in memory and retried with backoff until it
answers; applying one twice is harmless (the settle script is idempotent by ledger)."""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from dataclasses import dataclass

import structlog

from extproc.core.rules import Adjustment, UnconfirmedCharge
from extproc.errors import LimiterUnavailable
from extproc.limiter.base import Limiter
from extproc.metrics import Metrics

log = structlog.get_logger("extproc")


@dataclass(frozen=True, slots=True)
class Kept:
    """A settlement Redis did not take; applying it twice is harmless (keyed by ledger)."""

    ledger: str
    adjustments: list[Adjustment]
    ttl_ms: int
    request_id: str
    cancel: bool = False
    unconfirmed: UnconfirmedCharge | None = None


class SettlementQueue:
    """Deferred settlements, retried with backoff until Redis takes them (never dropped;
    bounded by the gateway pushing back on admissions,
    :meth:`extproc.background.Background.settlements_full`)."""

    def __init__(self, limiter: Limiter, metrics: Metrics) -> None:
        self.limiter = limiter
        self.metrics = metrics
        self.kept: deque[Kept] = deque()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self.kept)

    def keep(self, item: Kept) -> None:
        """Keep ``item``: never dropped (the gateway pushes back on admissions while the
        settlements waiting reach its backlog limit,
        :meth:`extproc.background.Background.settlements_full`)."""
        self.kept.append(item)
        self.metrics.settlements.labels("deferred").inc()
        self.metrics.settlement_backlog.set(len(self.kept))
        if self._task is None or self._task.done():
            # its own context: it runs on after the request that deferred first is gone
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._retry_loop(), context=contextvars.Context())

    async def _retry_once(self) -> bool:
        """Apply kept settlements in order; False at the first one Redis refuses."""
        while self.kept:
            item = self.kept[0]
            try:
                await self.limiter.settle(
                    item.ledger,
                    item.adjustments,
                    ledger_ttl_ms=item.ttl_ms,
                    cancel=item.cancel,
                    unconfirmed=item.unconfirmed,
                )
            except LimiterUnavailable:
                return False
            self.kept.popleft()
            self.metrics.settlements.labels("applied_late").inc()
            self.metrics.settlement_backlog.set(len(self.kept))
        return True

    async def _retry_loop(self) -> None:
        delay = 0.2
        while self.kept:
            await asyncio.sleep(delay)
            if await self._retry_once():
                log.info("settlements_recovered")
                return
            delay = min(delay * 2, 5.0)

    async def flush(self, grace_s: float) -> None:
        """On shutdown: try for ``grace_s`` seconds; log what could not be applied."""
        try:
            async with asyncio.timeout(grace_s):
                while self.kept and not await self._retry_once():  # noqa: ASYNC110
                    await asyncio.sleep(0.2)
        except TimeoutError:
            pass
        if self.kept:
            self.metrics.settlements.labels("dropped").inc(len(self.kept))
            log.error(
                "settlements_lost_on_shutdown",
                count=len(self.kept),
                ledgers=[k.ledger for k in list(self.kept)[:20]],
            )
        if self._task is not None:
            self._task.cancel()
