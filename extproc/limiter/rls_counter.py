"""The RLS API's counter on Redis: ``rls.lua`` run through the Redis limiter's caller.

:class:`RedisRlsCounter` is the :class:`extproc.limiter.base.RlsCounter` of envoyproxy/ratelimit's
protocol (:mod:`extproc.rls.service`) on the same Redis as the token quotas.  It owns only what
is RLS's own: the script's arguments, the call id that makes a retry count nothing twice, the
grouping by Cluster slot and what to journal.  The bounded timeout, the stall retry, the
circuit breaker, the slot's owner and the failover journal are the limiter's
:class:`extproc.limiter.caller.RedisCaller` (composed, as the
:class:`extproc.limiter.redis.RedisLimiter` composes it): an RLS check is one more call of it,
sharing its breaker and its connections.  The in-memory limiter is its own RLS counter
(:meth:`extproc.limiter.memory.MemoryLimiter.rls_check`).  :func:`rls_counter` gives the one
of a limiter.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from extproc.limiter.base import RlsCount, RlsCounter
from extproc.limiter.caller import RedisCaller
from extproc.limiter.layout import CALL_ID_TTL_MS, Packed, call_id_key
from extproc.limiter.redis import RedisLimiter

#: The script's name (``lua/rls.lua``), as registered on the caller and journalled.
SCRIPT = "rls"
#: rls.lua's second argument: "0" a check, "1" its replay (every counter shadow: counted,
#: never refused by a new master).
_CHECK, _REPLAY = "0", "1"


def check(call_id: str, counters: Sequence[RlsCount], *, replay: bool = False) -> Packed:
    """An ``rls.lua`` call (one slot): KEYS the call id's key, then each counter; ARGV the call
    id's TTL, check or replay, then 4 values per counter (hits, limit, expire-at, mode)."""
    p = Packed([call_id_key(counters[0][0], call_id)] + [c[0] for c in counters])
    p.args = [CALL_ID_TTL_MS, _REPLAY if replay else _CHECK]
    for _, hits, limit, expire, mode in counters:
        p.args += [hits, limit, expire, mode]
    return p


class RedisRlsCounter:
    """:class:`extproc.limiter.base.RlsCounter` on a :class:`RedisCaller`'s Redis."""

    def __init__(self, caller: RedisCaller) -> None:
        self.caller = caller
        caller.register(SCRIPT)

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
        admitted, before = True, [0] * len(counters)
        for idxs in self._by_slot(counters):
            mine = [counters[i] for i in idxs]
            call_id = uuid.uuid4().hex
            where = self.caller.owner(mine[0][0])
            res = await self.caller.run("a rate limit check", SCRIPT, check(call_id, mine), where)
            if int(res[0]) == 1 and any(c[1] > 0 for c in mine):
                replay = check(call_id, mine, replay=True)
                self.caller.journal(SCRIPT, replay, CALL_ID_TTL_MS, where)
            admitted = admitted and int(res[0]) == 1
            for i, v in zip(idxs, res[1], strict=True):
                before[i] = int(v)
        return admitted, before

    def _by_slot(self, counters: Sequence[RlsCount]) -> list[list[int]]:
        """Indexes of ``counters`` per Redis Cluster slot (one group on a single server)."""
        groups: dict[int, list[int]] = {}
        for i, c in enumerate(counters):
            groups.setdefault(self.caller.slot(c[0]), []).append(i)
        return list(groups.values())


def rls_counter(limiter: object) -> RlsCounter | None:
    """The RLS counter on ``limiter``'s store: the Redis limiter's through its machinery, an
    in-memory limiter's own; None for a limiter that has none (a test's recording wrapper:
    the RLS service then answers as when Redis is unavailable)."""
    if isinstance(limiter, RedisLimiter):
        return RedisRlsCounter(limiter.caller)
    if isinstance(limiter, RlsCounter):
        return limiter
    return None
