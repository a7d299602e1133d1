"""A request's waiting, as its admission keeps it (docs/semantics.md, "Waiting"): when it
first asked (its deadline counts from then), the turns it waited for, the call that holds its
ticket while it waits, and what its call's queue is.  Sans-IO; the rule itself is
:mod:`extproc.core.waiting` (admit.lua runs it)."""

from __future__ import annotations

from typing import Generic, TypeVar

from extproc.core.admission_rules import AdmissionRules
from extproc.core.admission_vocabulary import AdmissionAction, AdmitAnswered, Wait, WaitOver
from extproc.core.keys import WindowedBucket, tenant_tag
from extproc.core.session import Session
from extproc.core.waiting import (
    QueueCall,
    bucket_kinds,
    priority_offset_ms,
    queue_keys,
    wait_refusal,
)
from extproc.errors import QuotaExceeded

_A = TypeVar("_A")


class Waits(Generic[_A]):
    """One request's waiting (``_A``: what its admission keeps of a call out)."""

    __slots__ = ("arrival", "declined", "held", "turns")

    def __init__(self) -> None:
        self.arrival = 0  # when the request first asked
        self.turns = 0  # the turns it waited for
        self.held: _A | None = None  # the call whose answer gave it a ticket, while it waits
        # why its replica declined its wait (asked once more, no wait): "" (it did not),
        # "replica_full" or "draining" (WaitDeclined.why)
        self.declined = ""

    def queue(
        self,
        s: Session,
        rules: AdmissionRules,
        prefix: str,
        buckets: list[WindowedBucket],
        now: int,
    ) -> QueueCall | None:
        """The call's queue when the tenant's plan waits (None: it does not)."""
        tenant, key = s.tenant, s.key
        assert tenant is not None and key is not None
        rule = rules.wait_for(tenant.plan, tenant.id, key.name)
        if rule is None:
            return None
        self.arrival = self.arrival or now
        return QueueCall(
            queue_keys(tenant_tag(prefix, tenant.slot), tenant.slot),
            priority_offset_ms(rule.priority_for(s.priority_asked), rule.boost_ms),
            now if self.declined else self.arrival + rule.max_ms,  # declined: no wait left
            bucket_kinds(buckets),
            cap=rule.max_waiters,
        )

    def wait(self, asked: _A, res: AdmitAnswered, ticket: str, queue: QueueCall) -> Wait:
        """The call took a ticket: hold it until the turn."""
        self.held = asked
        self.turns += 1
        return Wait(res.turn_ms, ticket, queue.keys, first=self.turns == 1)

    def take(self) -> _A:
        """The call that held the ticket (the turn came, or the request went away)."""
        held = self.held
        assert held is not None
        self.held = None
        return held

    def waited_ms(self, now: int, queue: QueueCall | None) -> int:
        """How long it waited by ``now`` (-1: its plan does not wait)."""
        return now - self.arrival if queue is not None else -1

    def answered(
        self,
        err: QuotaExceeded | None,
        res: AdmitAnswered,
        now: int,
        out: list[AdmissionAction],
    ) -> QuotaExceeded | None:
        """A waiting plan's call answered, admitted (``err`` None) or refused: what it waited
        is counted; a refusal says why it did not wait and when its turn would have been."""
        waited = now - self.arrival
        if err is None:
            if self.turns:
                out.append(WaitOver("admitted", waited))
            return None
        if res.turn_ms == 0 and not self.turns:  # a budget, not a wait: an ordinary refusal
            return err
        err = wait_refusal(err, res, now, declined=self.declined, waited_ms=waited)
        how = self.declined or ("queue_full" if res.queue_full else "")
        out.append(WaitOver(how or ("refused" if self.turns else "unservable"), waited))
        return err
