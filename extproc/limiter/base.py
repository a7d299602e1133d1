"""The limiter protocol and its result types.

The request path talks to counters only through :class:`Limiter`.  Every method is one
round trip; every method is idempotent for a given ledger key (and sequence number).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from extproc.core.rules import Adjustment, BucketCharge, UnconfirmedCharge
from extproc.core.waiting import QueueCall

#: Most settlements riding on one admission (its script blocks Redis while it runs).
MAX_RIDERS = 32


def any_ledger(_: str) -> bool:
    """``rides_with`` where every settlement may ride on any admission (one store)."""
    return True


@dataclass(frozen=True, slots=True)
class Reclaimed:
    """A dead processor's request that an admission reclaimed: its ledger, the record draft
    its admission left there, the tokens the ledger had charged, and the exact input noted
    in it (:meth:`InputNoter.note_inputs`; -1 when none was: the draft's figure stands)."""

    ledger: str
    draft: str
    charged: int
    input: int = -1


@dataclass(frozen=True, slots=True)
class AdmitResult:
    """Outcome of an admission: ``values`` are the counters (after charging when admitted);
    ``reclaimed``, the requests of dead processors this call settled on the way; ``settled``,
    per settlement that rode on the call, True applied or False already settled."""

    admitted: bool
    duplicate: bool
    values: tuple[int, ...]
    reclaimed: tuple[Reclaimed, ...] = ()
    settled: tuple[bool, ...] = ()
    #: never-opened allowance units of dead replicas this call gave back (their leases ran out)
    allowance_reclaimed: int = 0
    #: a waiting request (:attr:`AdmitCall.queue`) not admitted: True it holds a ticket until
    #: ``turn_ms``; refused, ``turn_ms`` is the turn it would have needed (0: none computed,
    #: -1: never) and ``queue_full`` whether the tenant's queue was at its cap
    wait: bool = False
    turn_ms: int = 0
    queue_full: bool = False


@dataclass(frozen=True, slots=True)
class ChargeResult:
    """Outcome of a stream charge: tokens granted and whether a bucket is now exhausted."""

    granted: int
    exhausted: bool
    values: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SettleCall:
    """One request's settlement, as :meth:`Limiter.settle` takes it (for batches)."""

    ledger: str
    adjustments: list[Adjustment]
    ledger_ttl_ms: int
    cancel: bool = False
    unconfirmed: UnconfirmedCharge | None = None


class AdmitCall(NamedTuple):
    """One request's admission, as :meth:`Limiter.admit` takes it: its ledger, its buckets,
    the TPM tokens it charges (recorded in the ledger), whether a refused request still counts
    in its RPM buckets, the ledger's TTL; with a lease (``lease_until_ms``), the reservation
    stays open until settled and ``record_draft`` is kept in the ledger meanwhile (``now_ms``:
    the time a reclaim judges leases by); ``settlements`` ride on the call; with a ``queue``,
    a request over a rate limit may be told to wait (:mod:`extproc.core.waiting`).  (A named tuple:
    one is made per request, at a fifth of a frozen dataclass's cost.)"""

    ledger: str
    buckets: list[BucketCharge]
    tpm_charged: int
    count_refused: bool
    ledger_ttl_ms: int
    now_ms: int = 0
    lease_until_ms: int = 0
    record_draft: str = ""
    settlements: Sequence[SettleCall] = ()
    #: the request may wait for its turn (docs/semantics.md, "Waiting"): its queue
    queue: QueueCall | None = None


@dataclass(frozen=True, slots=True)
class ChargeCall:
    """One stream charge, as :meth:`Limiter.charge` takes it (for batches)."""

    ledger: str
    seq: int
    buckets: list[BucketCharge]
    amount: int
    strict: bool
    ledger_ttl_ms: int


@dataclass(frozen=True, slots=True)
class InputNote:
    """The exact input of a request admitted on an upper bound of it, for its open ledger:
    ``refund`` per counter key, the units admission charged beyond the exact input (a reclaim
    gives them back with the reservation)."""

    ledger: str
    input_tokens: int
    refund: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class AllowanceTake:
    """One counter's allowance asked for (:class:`AllowanceTaker`): up to ``want`` units, so
    that with the ``held`` units the replica still holds it holds at most ``share_ppm`` parts
    per million of the room left (``limit`` - value), and none when that is less than
    ``least``."""

    key: str
    want: int
    limit: int
    expire_at_ms: int
    share_ppm: int
    least: int = 1
    held: int = 0
    #: with a lease: the units of this counter the replica holds open (a grant opens what
    #: brings them up to one of its tranches at once; the rest is recorded, in tranches)
    opened: int = 0


@dataclass(frozen=True, slots=True)
class AllowanceLease:
    """How a take is leased (allowance.lua): the replica's allowance ledger for the tenant
    (``ledger``, next to its request ledgers), leased until ``until_ms`` like a reservation;
    a grant is split into ``tranches`` (the first open at once, the rest recorded in the
    ledger until opened, given back by a reclaim if the lease runs out)."""

    ledger: str
    now_ms: int
    until_ms: int
    tranches: int
    ttl_ms: int


class AllowanceGrant(NamedTuple):
    """A take's answer for one counter: units granted, the counter's value after, the
    allowance ledger's generation (a new one: what the replica recorded in the old one is
    gone, reclaimed or lost), and the units of dead replicas' allowances the call reclaimed
    (on the first item of a call), with the usage-record drafts of dead replicas' draft
    ledgers it reclaimed (their requests' records are the caller's to write)."""

    granted: int
    value: int
    gen: str = ""
    reclaimed: int = 0
    drafts: tuple[Reclaimed, ...] = ()


class AllowanceTaker(Protocol):
    """A limiter that pre-debits allowances for one replica (Redis and in-memory limiters)."""

    async def take_allowances(
        self, items: list[AllowanceTake], lease: AllowanceLease | None = None
    ) -> list[AllowanceGrant | None]:
        """Per item (granted units, counter value after, ...), or None when its call failed.
        Every item is of one tenant (one hash tag).  Never raises for Redis."""
        ...

    async def open_tranches(
        self, ledger: str, gen: str, items: list[tuple[str, int]]
    ) -> bool | None:
        """Open (counter, units) tranches of one allowance ledger (tranche.lua): True opened
        (the replica may draw from them), False the ledger of generation ``gen`` is no longer
        held (reclaimed: nothing opened), None the call failed (nothing opened here; if it ran after all, the
        record is only lower).  Never raises."""
        ...


class InputNoter(Protocol):
    """A limiter that notes exact inputs in open ledgers (Redis and in-memory limiters)."""

    async def note_inputs(self, notes: list[InputNote]) -> list[bool | None]:
        """Note each once in its ledger if the ledger is still open (admitted, not reclaimed
        nor settled): per note True written, False left as it was, None its call failed.
        Never raises for Redis."""
        ...


class InputStopStore(Protocol):
    """A limiter that shares the models whose input shortcut stopped (Redis and in-memory
    limiters): one hash per config version, ``key`` from
    :func:`extproc.core.keys.input_stops_key`."""

    async def stop_input_shortcut(self, key: str, model: str, entry: str, ttl_ms: int) -> bool:
        """Record that ``model``'s shortcut stopped (``entry``: what was found, kept from the
        first finder); True when this call recorded it.  Idempotent; raises
        :class:`extproc.errors.LimiterUnavailable` when Redis does not answer."""
        ...

    async def input_stops(self, key: str) -> list[str]:
        """The models whose shortcut stopped under ``key``'s config version (one read);
        raises :class:`extproc.errors.LimiterUnavailable` when Redis does not answer."""
        ...


class BatchSettler(Protocol):
    """A limiter that settles many requests per round trip (:class:`RedisLimiter`)."""

    async def settle_many(self, items: list[SettleCall]) -> list[bool | None]:
        """Settle each item once, as :meth:`Limiter.settle` would: per item, True applied,
        False already settled (by this call or an earlier one), None not settled because its
        call failed (Redis unavailable; retrying it is harmless).  Never raises for Redis."""
        ...


class BatchCharger(Protocol):
    """A limiter that charges many streams per round trip (:class:`RedisLimiter`)."""

    async def charge_many(self, items: list[ChargeCall]) -> list[ChargeResult | None]:
        """Charge each item as :meth:`Limiter.charge` would (idempotent by ledger and
        sequence number); None for an item whose call failed.  Never raises for Redis."""
        ...


#: One counter of an RLS request (envoyproxy/ratelimit's protocol, :mod:`extproc.rls`): its
#: key, the hits to add (0: check only), its limit, its expiry (unix ms: the end of its fixed
#: window plus slack) and its mode (:data:`RLS_SHADOW`, :data:`RLS_ENFORCED`, :data:`RLS_QUOTA`).
RlsCount = tuple[str, int, int, int, int]

#: Counted, never refuses (a ``shadow_mode`` rule).
RLS_SHADOW = 0
#: Refuses the request when over.
RLS_ENFORCED = 1
#: ``quota_mode``: the request is refused only when every quota-mode counter is over.
RLS_QUOTA = 2


@runtime_checkable
class RlsCounter(Protocol):
    """The RLS API's fixed-window request counters, on the limiter's store (Redis:
    :class:`extproc.limiter.rls_counter.RedisRlsCounter`; in memory: the
    :class:`~extproc.limiter.memory.MemoryLimiter` itself)."""

    async def rls_check(self, counters: Sequence[RlsCount]) -> tuple[bool, list[int]]:
        """Check every counter of one request and count them all or none (on Redis Cluster:
        all or none per slot, docs/rls.md): a counter is over
        when its value plus its hits exceeds its limit; the request is refused when an
        enforced counter is, or every quota-mode one is (then nothing is added); otherwise
        each counter gets its hits, a new one its expiry.  The same key twice: the second
        sees the first's hits.  Returns (admitted, each counter's value before the request).
        Raises :class:`extproc.errors.LimiterUnavailable`; idempotent under retries."""
        ...


class Limiter(Protocol):
    """Shared counters. Implementations raise :class:`extproc.errors.LimiterUnavailable`."""

    async def admit(self, call: AdmitCall) -> AdmitResult:
        """Check every bucket and charge all of them, or none (shadow buckets never refuse).

        ``call.settlements`` ride on the call: each is applied first, once, as
        :meth:`BatchSettler.settle_many` would (what they refund is room this admission may
        use), whatever the admission's outcome (refused, duplicate); ``AdmitResult.settled``
        answers per settlement.  If the call raises, none is known applied (retrying is
        harmless: each is idempotent by its ledger).

        With a lease (``lease_until_ms``), the reservation is open until settled; when its
        lease runs out unrenewed (the processor died), the next admission of the tenant
        refunds each bucket's ``refundable`` part, frees its concurrency slots and returns
        its ``record_draft`` (kept in the ledger while the request is open) in
        ``AdmitResult.reclaimed``."""
        ...

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
        """Charge (lazy) or lease (strict) ``amount`` output tokens; each bucket gets
        ``ceil(granted * rate / RATE_SCALE)`` units."""
        ...

    async def settle(
        self,
        ledger: str,
        adjustments: list[Adjustment],
        *,
        ledger_ttl_ms: int,
        cancel: bool = False,
        unconfirmed: UnconfirmedCharge | None = None,
    ) -> bool:
        """Apply the final corrections once; False when already settled.

        ``cancel``: the admission call failed on our side; undo it only if it ran after all
        (and make sure it never runs later).  ``unconfirmed``: the last stream charge whose
        answer never came; what it added is taken back if it ran."""
        ...

    async def renew(
        self, ledgers: list[str], until_ms: int, *, held: dict[str, list[str]] | None = None
    ) -> None:
        """Extend the leases of these open reservations, and of the concurrency slots
        ``held[ledger]`` names, to ``until_ms``."""
        ...

    async def leave_queue(self, ledger: str, keys: tuple[str, str, str]) -> bool:
        """Remove a waiting request's ticket (``ledger``) from its tenant's queue ``keys``
        (:class:`extproc.core.waiting.QueueCall`); True when one was there.  Idempotent."""
        ...

    async def read(self, keys: list[str]) -> list[int]:
        """Current counter values (0 for missing keys)."""
        ...

    async def count_slots(self, keys: list[str], now_ms: int) -> list[int]:
        """Live (unexpired) slots of these concurrency sets."""
        ...

    async def count_members(self, keys: list[str]) -> list[int]:
        """Members of these sets (a team's distinct end users in a window; 0 when missing)."""
        ...

    async def ping(self) -> bool:
        """Whether the backend answers."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...
