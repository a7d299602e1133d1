"""The allowance wrapper's settings, bounds and state: each bucket's allowance
(:class:`Bucket`), each tenant's allowance ledger (:class:`Lease`) and draft ledger
(:class:`Drafts`), the requests admitted from allowances (:class:`Local`), and the one object
that holds them all (:class:`Book`), which every part of the wrapper is given."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import uuid
from collections import OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from extproc.clock import Clock
from extproc.limiter.allowance.stats import AllowanceStats, Tally
from extproc.limiter.base import (
    AllowanceTaker,
    BatchSettler,
    Limiter,
    Reclaimed,
    SettleCall,
)

if TYPE_CHECKING:
    from extproc.metrics import Metrics

#: Bucket states kept at most (beyond, new buckets' admissions go to Redis).
MAX_STATES = 50_000
#: Requests admitted from allowances remembered at most (until settled).  Modes that settle
#: nothing (``input_only``, ``reserve_max``, RPM only) never come back: the oldest is forgotten
#: (a later charge or settlement of it goes to Redis, which counts it right all the same).
MAX_LEDGERS = 100_000
#: Settled local ledgers remembered (a duplicate settlement answers "already settled").
MAX_SETTLED = 100_000
#: A bucket state with nothing held and no admission for this long is forgotten.
IDLE_MS = 30_000


class AllowanceBackend(Limiter, AllowanceTaker, BatchSettler, Protocol):
    """What the wrapper needs of the limiter it wraps."""


@dataclass(frozen=True, slots=True)
class AllowanceSettings:
    """How allowances are sized and kept (``AIQ_ALLOWANCE_*``, docs/semantics.md)."""

    share: float = 0.1
    ttl_ms: int = 2_000
    min_rate: float = 8.0
    max_window_s: int = 3_600
    return_ledger_ttl_ms: int = 60_000
    #: a grant is split into this many tranches; the replica draws only from opened ones
    tranches: int = 4
    #: the allowance ledger's lease (``failure.reservation_lease_seconds``): renewed while
    #: this replica lives; once it runs out, the never-opened tranches go back to the tenant
    lease_ms: int = 15_000
    #: how often the usage-record drafts of requests admitted from allowances are sent (a
    #: SIGKILL loses the records of those admitted in the last interval)
    draft_flush_ms: int = 1_000

    @property
    def share_ppm(self) -> int:
        """``share`` in parts per million (the script's unit)."""
        return round(self.share * 1_000_000)


@dataclass(slots=True)
class Bucket:
    """One counter's allowance on this replica and what this replica saw of the bucket."""

    key: str
    tag: str
    limit: int
    expire_at_ms: int
    units: int = 0  # held: pre-debited in Redis, not drawn yet (``closed`` included)
    closed: int = 0  # of ``units``, not opened yet: recorded in the allowance ledger
    tranche: int = 0  # the last grant's tranche size
    releasing: int = 0  # never-opened units being given back (opened first, then refunded)
    opening: int = 0  # of ``closed``, being opened by a tranche call in flight
    deadline_ms: int = 0  # drawn from until then; the rest then goes back
    seen: int = 0  # the counter's value last answered (every replica's allowances included)
    second: int = 0
    hits: int = 0  # admissions this second
    hits_prev: int = 0  # admissions in the second before
    drawn: int = 0  # units drawn here since ``since_ms`` (the demand sizing follows)
    since_ms: int = 0
    largest: int = 0  # largest amount one admission asked for (decays at each take)
    taking: bool = False
    touched_ms: int = 0
    quiet_until_ms: int = 0  # a take found the tenant near its limit: none asked until then


@dataclass(slots=True)
class Lease:
    """This replica's allowance ledger for one tenant (allowance.lua, tranche.lua)."""

    ledger: str
    gen: str = ""  # its generation as last answered ("": none yet, or reclaimed)
    opening: bool = False  # a tranche call in flight
    task: asyncio.Task[None] | None = None
    renewed_ms: int = 0


@dataclass(slots=True)
class Local:
    """A request admitted from allowances (no ledger in Redis unless a charge went there)."""

    seq: int = 0  # the last stream charge's sequence number
    redis_seq: int = 0  # the last charge sent to Redis (0: none; its ledger exists there)
    last_local: tuple[int, tuple[tuple[str, int], ...]] = (0, ())
    settled: bool = False
    remainder: SettleCall | None = None
    tag: str = ""  # the tenant's hash tag (its draft ledger's)
    draft: str = ""  # its usage-record draft ("": none)
    charged: int = 0  # tokens charged: admission and every stream charge (as a ledger's)


@dataclass(slots=True)
class Drafts:
    """This replica's draft ledger for one tenant (drafts.lua): the usage-record drafts of
    the requests it admitted from allowances and has not settled."""

    ledger: str
    ttl_ms: int = 0
    open: dict[str, None] = dataclasses.field(default_factory=dict)  # not settled
    #: of ``open``, the drafts not sent yet, oldest first: since when each waits (its
    #: admission, or the flush that has to send it again)
    waiting: dict[str, int] = dataclasses.field(default_factory=dict)
    sent: dict[str, int] = dataclasses.field(default_factory=dict)  # kept: charged as sent
    drops: list[str] = dataclasses.field(default_factory=list)  # sent, settled since
    #: Redis-admitted requests' tokens charged here, not yet in their ledgers' "charged"
    charged_more: dict[str, int] = dataclasses.field(default_factory=dict)
    more_since_ms: int = 0
    pending_ms: int = 0  # since when a drop waits (0: none)
    retry_ms: int = 0  # a failed call: drafts and drops go again from then on

    def touch(self, now: int) -> None:
        """A drop now waits for the next flush."""
        if not self.pending_ms:
            self.pending_ms = now

    def wait(self, ledger: str, now: int) -> None:
        """The draft of ``ledger`` (open, not sent) waits from ``now`` (the newest)."""
        self.waiting.pop(ledger, None)
        self.waiting[ledger] = now

    renewed_ms: int = 0
    flushing: bool = False


class Book:
    """Everything the wrapper keeps on this replica, in one place: the parts (takes, returns,
    tranches, drafts, settlements) each read and change it, none keeps state of its own."""

    def __init__(
        self,
        settings: AllowanceSettings,
        clock: Clock,
        *,
        metrics: Metrics | None = None,
        keeps_drafts: bool = True,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.stats = AllowanceStats()
        self.tally = Tally(self.stats, metrics)
        #: each bucket's allowance, by counter key
        self.states: dict[str, Bucket] = {}
        #: requests admitted from allowances, oldest first; and those settled since
        self.ledgers: OrderedDict[str, Local] = OrderedDict()
        self.settled: OrderedDict[str, None] = OrderedDict()
        #: give-backs to send (settle.lua refunds), sent again until answered
        self.returns: list[SettleCall] = []
        #: each tenant's allowance ledger and draft ledger, by hash tag
        self.leases: dict[str, Lease] = {}
        self.drafts: dict[str, Drafts] = {}
        #: a backend a process death cannot lose counts with (in-memory) keeps no drafts
        self.keeps_drafts = keeps_drafts
        #: requests Redis admitted that had stream charges drawn from allowances
        self.mixed: OrderedDict[str, Local] = OrderedDict()
        #: drafts of dead replicas' requests a take reclaimed: the next admission carries them
        self.reclaimed: list[Reclaimed] = []
        #: background calls in flight (takes, tranche openings, give-backs)
        self.tasks: set[asyncio.Task[None]] = set()
        self.instance = uuid.uuid4().hex[:12]
        self._serial = itertools.count()
        self.closed = False

    def serial(self) -> int:
        """A number no other ledger of this replica's got."""
        return next(self._serial)

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``work`` in the background (kept until done: :meth:`close` waits for it)."""
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task
