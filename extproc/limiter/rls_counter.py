"""The RLS API's counter on Redis: ``rls.lua`` run through the Redis limiter's machinery.

:class:`RedisRlsCounter` is the :class:`extproc.limiter.base.RlsCounter` of envoyproxy/ratelimit's
protocol (:mod:`extproc.rls.service`) on the same Redis as the token quotas.  It owns only what
is RLS's own: the script's arguments, the call id that makes a retry count nothing twice, the
grouping by Cluster slot and what to journal.  The bounded timeout, the stall retry, the
circuit breaker, the slot's owner and the failover journal are the limiter's
(:class:`extproc.limiter.redis.RedisLimiter`, by composition): an RLS check is one more call
of it, sharing its breaker and its connections.  The in-memory limiter is its own RLS counter
(:meth:`extproc.limiter.memory.MemoryLimiter.rls_check`).  :func:`rls_counter` gives the one
of a limiter.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from extproc.limiter.base import RlsCount, RlsCounter
from extproc.limiter.redis import RLS_CALL_ID_TTL_MS, RedisLimiter, call_id_key

#: The script's name (``lua/rls.lua``), as registered on the limiter and journalled.
SCRIPT = "rls"


class RedisRlsCounter:
    """:class:`extproc.limiter.base.RlsCounter` on a :class:`RedisLimiter`'s Redis."""

    def __init__(self, limiter: RedisLimiter) -> None:
        self.limiter = limiter
        limiter.register(SCRIPT)

    async def rls_check(self, counters: Sequence[RlsCount]) -> tuple[bool, list[int]]:
        """Run ``rls.lua``: check every (key, hits, limit, expire-at ms, mode) counter of one
        RLS request and count them all or none; (admitted, values before the request).

        On Redis Cluster the counters are grouped by slot (keys hash-tagged to one slot are
        one call); a request whose counters span slots is checked in one call per slot, each
        all or nothing (docs/rls.md: the slot strategy).  Each call carries a fresh id (a key
        in its counters' slot): a retry after a timeout, or a replay to a new master, whose
        first run counted returns that run's answer and counts nothing."""
        if not counters:
            return True, []
        lim = self.limiter
        admitted, before = True, [0] * len(counters)
        for idxs in self._by_slot(counters):
            first = counters[idxs[0]][0]
            keys = [call_id_key(first, uuid.uuid4().hex)] + [counters[i][0] for i in idxs]
            args: list[Any] = [RLS_CALL_ID_TTL_MS, "0"]
            for i in idxs:
                _, hits, limit, expire, mode = counters[i]
                args += [hits, limit, expire, mode]
            where = lim.owner(first)
            res = await lim.run("a rate limit check", SCRIPT, keys, args, where)
            if int(res[0]) == 1 and any(counters[i][1] > 0 for i in idxs):
                # replayed as "1": counted as shadow, never refused, by a new master
                replay = [RLS_CALL_ID_TTL_MS, "1", *args[2:]]
                lim.journal(SCRIPT, keys, replay, RLS_CALL_ID_TTL_MS, where)
            admitted = admitted and int(res[0]) == 1
            for i, v in zip(idxs, res[1], strict=True):
                before[i] = int(v)
        return admitted, before

    def _by_slot(self, counters: Sequence[RlsCount]) -> list[list[int]]:
        """Indexes of ``counters`` per Redis Cluster slot (one group on a single server)."""
        groups: dict[int, list[int]] = {}
        for i, c in enumerate(counters):
            groups.setdefault(self.limiter.slot(c[0]), []).append(i)
        return list(groups.values())


def rls_counter(limiter: object) -> RlsCounter | None:
    """The RLS counter on ``limiter``'s store: the Redis limiter's through its machinery, an
    in-memory limiter's own; None for a limiter that has none (a test's recording wrapper:
    the RLS service then answers as when Redis is unavailable)."""
    if isinstance(limiter, RedisLimiter):
        return RedisRlsCounter(limiter)
    if isinstance(limiter, RlsCounter):
        return limiter
    return None
