"""The write lock of one gRPC stream: its servicer loop and a shutdown cut never write at once.

grpc.aio allows one write at a time per stream.  Two writers share a stream: the servicer's
loop, once per message, and :meth:`RequestProcessor.cut_for_shutdown`, once at most.  The loop
nearly always finds the lock free, so taking a free lock is a plain call (:meth:`try_acquire`),
not the three coroutines of ``async with asyncio.Lock()``; a writer that finds it held waits its
turn (FIFO) and is handed the lock directly by :meth:`release`, so no newcomer can take it in
between.
"""

from __future__ import annotations

import asyncio
from collections import deque
from types import TracebackType


class WriteLock:
    """A mutex for the writers of one stream, cheap to take when free."""

    __slots__ = ("_held", "_waiters")

    def __init__(self) -> None:
        self._held = False
        self._waiters: deque[asyncio.Future[None]] = deque()

    def locked(self) -> bool:
        """Someone holds the lock."""
        return self._held

    def try_acquire(self) -> bool:
        """Take the lock if it is free (True); never waits."""
        if self._held:
            return False
        self._held = True
        return True

    async def acquire(self) -> None:
        """Take the lock, waiting behind the writers already waiting for it."""
        if not self._held:
            self._held = True
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # it was handed to us as we were cancelled: pass it on
            elif fut in self._waiters:
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        """Hand the lock to the first writer still waiting, or free it."""
        if not self._held:
            raise RuntimeError("WriteLock released while not held")
        waiters = self._waiters
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # handed over: it stays held
                return
        self._held = False

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
