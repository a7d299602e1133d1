"""A short journal of the charges Redis acknowledged, replayed to a new master after a failover.

Redis replicates asynchronously: a master that dies (or restarts from an AOF fsynced every
second) can take with it writes it had already acknowledged, and a promoted replica that never
saw them hands that quota out again.  Each processor therefore keeps, for a few seconds, every
script call that changed counters and that Redis answered, in the form that replays it: the
same idempotency key (the ledger and sequence number of admissions, stream charges and
settlements; the call id of an RLS check) and nothing that could refuse it (an admission's
buckets as shadow buckets, a strict lease as the lazy charge of what was granted, an RLS check
with every counter in shadow mode).  When the master changes, the limiter sends the journal to
the new master: a call the new master already has is a no-op, a lost one is applied once,
whatever the new master got first (:mod:`extproc.limiter.failover`).

Bounded: entries older than ``window_s`` are dropped while Redis is answering with the same
master (they were replicated long ago), never while it is not (the journal must outlive the
failure detection window); and at most ``max_entries`` are kept (the oldest go first, counted
as dropped).  An entry is never replayed after its idempotency key may have expired
(``until``): the ledger's TTL, or the RLS call id's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

#: Default: keep acknowledged charges this long while Redis answers (s).
DEFAULT_WINDOW_S = 10.0
#: Default: at most this many entries per process.
DEFAULT_MAX_ENTRIES = 50_000


@dataclass(slots=True)
class Entry:
    """One acknowledged script call, in its replay form."""

    at: float  # monotonic seconds: when Redis acknowledged it
    until: float  # monotonic seconds: its idempotency key may be gone after this
    script: str  # admit | charge | settle | rls
    keys: list[str]
    args: list[Any]
    slot: int  # the Cluster slot of its keys (0 on a single server or Sentinel master)
    owner: str  # the run id of the master that acknowledged it ("" unknown)


class Journal:
    """The acknowledged charges of the last ``window_s`` seconds (see the module)."""

    def __init__(
        self, *, window_s: float = DEFAULT_WINDOW_S, max_entries: int = DEFAULT_MAX_ENTRIES
    ) -> None:
        if window_s <= 0 or max_entries <= 0:
            raise ValueError("a journal needs a positive window and size")
        self.window_s = window_s
        self.max_entries = max_entries
        self._entries: deque[Entry] = deque()
        self._per_slot: dict[int, int] = {}
        self.dropped = 0  # entries pushed out by max_entries before their window ended

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries)

    def add(self, entry: Entry) -> None:
        """Keep ``entry`` (the oldest entry goes when the journal is full)."""
        if len(self._entries) >= self.max_entries:
            self._forget(self._entries.popleft())
            self.dropped += 1
        self._entries.append(entry)
        self._per_slot[entry.slot] = self._per_slot.get(entry.slot, 0) + 1

    def _forget(self, entry: Entry) -> None:
        left = self._per_slot[entry.slot] - 1
        if left:
            self._per_slot[entry.slot] = left
        else:
            del self._per_slot[entry.slot]

    def confirm(self, now: float) -> None:
        """Redis answered with the same master at ``now``: entries older than the window
        were replicated long ago (or are lost beyond repair): drop them."""
        horizon = now - self.window_s
        entries = self._entries
        while entries and entries[0].at < horizon:
            self._forget(entries.popleft())

    def replayable(self, now: float) -> list[Entry]:
        """The entries whose idempotency key still holds at ``now``, oldest first."""
        return [e for e in self._entries if e.until > now]

    def holds(self, slot: int) -> bool:
        """Whether an entry of ``slot`` is held."""
        return slot in self._per_slot
