"""Timeouts that do not blame Redis for the processor's own lack of CPU.

A Redis call is bounded by ``timeout_ms`` of wall-clock time.  When the processor itself cannot
run (a CPU model server on the same cores, a Kubernetes CPU limit throttling the pod, a long
synchronous step on the event loop), the clock keeps going while neither the request nor the
answer can be handled: the answer sits in the socket buffer and the timer, firing late in the
same loop iteration, cancels the call that has in fact succeeded.  Seen against a real vLLM on
shared cores: Redis answered in microseconds, the processor waited 6.4 s for CPU, and requests
failed as ``quota_backend_unavailable``.

:class:`LoopLag` measures how late the event loop runs (a cheap timer every
``interval_s``); :func:`fair_wait` gives a call its full timeout of *running* time: when the
wait expires, the time the loop was late during it is added to the deadline (up to a hard
ceiling), so a starved processor is slower, not failed, while a Redis that does not answer is
still detected after ``timeout`` once the processor runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

#: Lateness below this is scheduling noise, not starvation.
NOISE_S = 0.005


class LoopLag:
    """Seconds the event loop ran late in total (a timer that notes how late it fires)."""

    def __init__(
        self, interval_s: float = 0.05, *, clock: Callable[[], float] | None = None
    ) -> None:
        self.interval_s = interval_s
        #: the time lateness is measured in (None: the running loop's own clock)
        self._clock = clock
        self.total = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def ensure_started(self) -> None:
        """Start ticking on the running loop (once per loop)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._handle is not None:
            return
        self._loop = loop
        self._due = self._now(loop) + self.interval_s
        self._handle = loop.call_later(self.interval_s, self._tick)

    def _now(self, loop: asyncio.AbstractEventLoop) -> float:
        return (self._clock or loop.time)()

    def _tick(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        now = self._now(loop)
        late = now - self._due
        if late > NOISE_S:
            self.total += late
        self._due = now + self.interval_s
        self._handle = loop.call_later(self.interval_s, self._tick)

    def stop(self) -> None:
        """Stop ticking."""
        if self._handle is not None:
            self._handle.cancel()
        self._handle = None
        self._loop = None


async def fair_wait(
    aw: Awaitable[T],
    budget_s: float,
    lag: LoopLag,
    ceiling: float,
    *,
    clock: Callable[[], float] | None = None,
) -> T:
    """``await aw`` within ``budget_s`` seconds of the processor's running time, never longer
    than ``ceiling`` seconds of wall time; raise :class:`TimeoutError` when it does not finish
    (the call is cancelled).  ``clock``: the time waited in (None: the running loop's)."""
    now_s = clock or asyncio.get_running_loop().time
    lag.ensure_started()
    task = asyncio.ensure_future(aw)
    start = now_s()
    deadline = start + budget_s
    seen = lag.total
    try:
        while True:
            await asyncio.wait((task,), timeout=max(0.0, deadline - now_s()))
            if not task.done():
                # An answer that arrived with this late wake-up is read in the next turns.
                for _ in range(3):
                    await asyncio.sleep(0)
                    if task.done():
                        break
            if task.done():
                return task.result()
            now = now_s()
            starved = max(lag.total - seen, now - deadline)
            seen = lag.total
            if starved <= NOISE_S or now - start >= ceiling:
                raise TimeoutError(f"no answer within {budget_s:.3f}s")
            deadline = min(start + ceiling, deadline + starved)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
