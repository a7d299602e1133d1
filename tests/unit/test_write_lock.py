"""The stream write lock: one writer at a time, waiters served in order, cancellation safe."""

from __future__ import annotations

import asyncio

import pytest

from extproc.server.writelock import WriteLock

pytestmark = pytest.mark.unit


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_free_lock_is_taken_without_waiting() -> None:
    """try_acquire takes a free lock and refuses a held one."""
    lock = WriteLock()
    assert lock.try_acquire()
    assert lock.locked()
    assert not lock.try_acquire()
    lock.release()
    assert not lock.locked()
    assert lock.try_acquire()


async def test_writers_never_overlap_and_wait_in_order() -> None:
    """Writers holding the lock across awaits never overlap; waiters get it in arrival order."""
    lock = WriteLock()
    inside = 0
    most = 0
    order: list[int] = []

    async def writer(i: int) -> None:
        nonlocal inside, most
        if not lock.try_acquire():
            await lock.acquire()
        try:
            inside += 1
            most = max(most, inside)
            order.append(i)
            await _turns(3)
            inside -= 1
        finally:
            lock.release()

    await asyncio.gather(*(writer(i) for i in range(6)))
    assert most == 1
    assert order == list(range(6))
    assert not lock.locked()


async def test_release_hands_over_before_a_newcomer() -> None:
    """A newcomer's try_acquire fails while the lock is handed to the waiter already queued."""
    lock = WriteLock()
    assert lock.try_acquire()
    waiter = asyncio.ensure_future(lock.acquire())
    await _turns()
    lock.release()
    assert lock.locked()
    assert not lock.try_acquire()
    await waiter
    lock.release()
    assert not lock.locked()


async def test_cancelled_waiter_leaves_the_queue() -> None:
    """A waiter cancelled before its turn never gets the lock; the next one does."""
    lock = WriteLock()
    assert lock.try_acquire()
    first = asyncio.ensure_future(lock.acquire())
    second = asyncio.ensure_future(lock.acquire())
    await _turns()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    lock.release()
    await asyncio.wait_for(second, 1.0)
    assert lock.locked()
    lock.release()
    assert not lock.locked()


async def test_waiter_cancelled_after_handover_passes_the_lock_on() -> None:
    """A waiter cancelled just after the lock was handed to it releases it to the next."""
    lock = WriteLock()
    assert lock.try_acquire()
    first = asyncio.ensure_future(lock.acquire())
    second = asyncio.ensure_future(lock.acquire())
    await _turns()
    lock.release()  # handed to ``first``, which has not run yet
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1.0)
    assert lock.locked()
    lock.release()
    assert not lock.locked()


async def test_context_manager_and_release_when_free() -> None:
    """``async with`` takes and frees it; releasing a free lock is an error."""
    lock = WriteLock()
    async with lock:
        assert lock.locked()
    assert not lock.locked()
    with pytest.raises(RuntimeError):
        lock.release()
