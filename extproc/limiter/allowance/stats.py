"""What the allowance wrapper did: its counts (tests and the bench read them) and the
Prometheus metrics that export the same."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from extproc.metrics import Metrics


@dataclass
class AllowanceStats:
    """What the wrapper did (tests and the bench read it; the metrics export the same)."""

    local_admissions: int = 0
    local_charges: int = 0
    local_settlements: int = 0
    taken: int = 0
    returned: int = 0
    expired: int = 0
    takes: int = 0
    opens: int = 0
    reclaimed: int = 0  # dead replicas' never-opened units this replica's calls gave back
    draft_calls: int = 0  # drafts.lua calls
    drafts_sent: int = 0  # drafts kept in Redis (requests still open at a flush)


class Tally:
    """Counts what the wrapper did into its :class:`AllowanceStats` and its metrics."""

    def __init__(self, stats: AllowanceStats, metrics: Metrics | None) -> None:
        self.stats = stats
        self.metrics = metrics

    def units(self, event: str, units: int) -> None:
        """Units ``event`` (taken, returned, expired, reclaimed)."""
        if event == "taken":
            self.stats.taken += units
        elif event == "returned":
            self.stats.returned += units
        elif event == "expired":
            self.stats.expired += units
        elif event == "reclaimed":
            self.stats.reclaimed += units
        m = self.metrics
        if m is not None and units > 0:
            m.allowance_units.labels(event).inc(units)

    def take(self, outcome: str) -> None:
        """A take answered (granted, none, failed)."""
        m = self.metrics
        if m is not None:
            m.allowance_takes.labels(outcome).inc()

    def saved(self, call: str) -> None:
        """A limiter call served here instead of in Redis."""
        m = self.metrics
        if m is not None:
            m.allowance_saved_calls.labels(call).inc()
