"""The in-memory limiter's queues: admit.lua's queue section, step by step, with the rule of
:func:`extproc.core.waiting.decide` (docs/semantics.md, "Waiting")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from extproc.core.waiting import Decision, Outcome, QueueBucket, QueueCall, decide
from extproc.limiter.base import AdmitCall
from extproc.limiter.keyspace import Keyspace


class Judged(NamedTuple):
    """An admission's verdict: ``ok`` admit, ``wait`` keep the ticket until ``turn``;
    refused, ``turn`` the one it would have needed and ``full`` the tenant's queue was full."""

    ok: bool
    wait: bool = False
    turn: int = 0
    full: bool = False


class MemoryQueues:
    """Every tenant's queue: queue key -> ticket -> (score, lease deadline, tokens)."""

    def __init__(self) -> None:
        self.queues: dict[str, dict[str, tuple[int, int, int]]] = {}
        self._stamp = 0  # the last ticket's arrival stamp (microseconds)

    def judge(
        self,
        call: AdmitCall,
        vals: Sequence[int],
        prev: Sequence[int],
        known: set[int],
        *,
        keys: Keyspace,
        now: int,
    ) -> Judged:
        """admit.lua's verdict on ``call`` (the buckets' values as found, their previous
        windows' shares, the ``users`` buckets that know the end user; ``now`` the keyspace's
        time): without a queue, room for the request in every bucket; with one, the rule."""
        q = call.queue
        if q is None:
            ok = all(
                b.shadow or b.amount <= 0 or i in known or vals[i] + b.amount <= b.limit
                for i, b in enumerate(call.buckets)
            )
            return Judged(ok)
        previous = [keys.counter_value(b.prev_key, now) if b.prev_key else 0 for b in call.buckets]
        d, full = self._decide(call, q, vals, prev, previous, known, now)
        ok = d.outcome is Outcome.ADMITTED
        return Judged(ok, d.outcome is Outcome.WAIT, d.turn_ms, full)

    def _decide(  # noqa: PLR0917 - admit.lua's state, as it reads it
        self,
        call: AdmitCall,
        q: QueueCall,
        vals: Sequence[int],
        prev: Sequence[int],
        previous: Sequence[int],
        known: set[int],
        clock_ms: int,
    ) -> tuple[Decision, bool]:
        """admit.lua's decision for ``call`` (values as found, each bucket's previous-window
        share and whole previous counter, the ``users`` buckets that know the end user):
        lapsed tickets go first; a wait keeps or takes the ticket (its arrival stamped by the
        clock, strictly increasing), anything else drops it.  With whether the tenant's queue
        was full."""
        ledger, now_ms = call.ledger, call.now_ms
        tickets = self.queues.setdefault(q.keys[0], {})
        for t in [t for t, (_, lease, _) in tickets.items() if lease <= now_ms]:
            del tickets[t]
        order = sorted(tickets, key=lambda t: (tickets[t][0], t))
        ticketed = ledger in tickets
        # a newcomer's place: its arrival stamp (strictly increasing) less its priority offset
        stamp = max(clock_ms * 1000, self._stamp + 1)
        score = tickets[ledger][0] if ticketed else stamp - q.offset_ms * 1000
        ahead = (
            order[: order.index(ledger)]
            if ticketed
            else [t for t in order if tickets[t][0] < score]
        )
        ahead_t = sum(tickets[t][2] for t in ahead)
        sizes = tuple(tickets[t][2] for t in ahead)
        qb = [
            QueueBucket(
                kind,
                vals[i],
                0 if i in known else b.amount,
                b.limit,
                ahead=(ahead_t if b.kind == "tpm" else len(ahead)) if kind != "none" else 0,
                sizes=sizes if b.kind == "tpm" and kind in ("fixed", "sliding") else (),
                window_end_ms=end,
                window_ms=length,
                current=vals[i] - prev[i],
                previous=previous[i],
                shadow=b.shadow,
            )
            for i, (b, (kind, end, length)) in enumerate(zip(call.buckets, q.buckets, strict=True))
        ]
        d = decide(qb, now_ms, q.deadline_ms, queued=len(tickets), cap=q.cap, ticketed=ticketed)
        if d.outcome is Outcome.WAIT:
            if not ticketed:
                self._stamp = stamp
            tickets[ledger] = (score, d.turn_ms + q.lease_ms, call.tpm_charged)
            return d, False
        full = not ticketed and 0 < q.cap <= len(tickets) and 0 < d.turn_ms <= q.deadline_ms
        tickets.pop(ledger, None)
        return d, full

    def leave(self, ledger: str, queue: str) -> bool:
        """leave.lua: True when the ticket was there."""
        return self.queues.get(queue, {}).pop(ledger, None) is not None
