"""A circuit breaker that opens on a failure *rate*, not on one failure.

States (the ``aiq_breaker_state`` gauge uses the numbers):

- ``CLOSED`` (0): every call goes to Redis; each outcome is recorded in a rolling window of
  ``window_s`` seconds (``buckets`` slices).  When a failure brings the window to at least
  ``min_calls`` calls with a failure rate of at least ``failure_rate``, the breaker opens.  A
  single slow or failed call therefore never opens it (``min_calls`` is at least 2).
- ``OPEN`` (2): calls fail at once, without touching Redis, for ``open_s`` seconds.
- ``HALF_OPEN`` (1): up to ``probes`` calls are let through at a time; the others fail at once.
  ``probes`` successes in a row close the breaker (with an empty window); any failure opens it
  again for another ``open_s``.

Time comes from the injected :class:`extproc.clock.Clock` (monotonic seconds), so tests drive
the state machine with :class:`extproc.clock.FakeClock`.  Not thread-safe: one event loop.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from extproc.clock import Clock


class BreakerState(enum.IntEnum):
    """The breaker's state; the value is what ``aiq_breaker_state`` exports."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """How the breaker decides (defaults suit hundreds of calls per second per process)."""

    failure_rate: float = 0.5
    min_calls: int = 20
    window_s: float = 2.0
    buckets: int = 10
    open_s: float = 1.0
    probes: int = 3

    def __post_init__(self) -> None:
        if not 0.0 < self.failure_rate <= 1.0:
            raise ValueError("failure_rate must be in (0, 1]")
        if self.min_calls < 2:
            raise ValueError("min_calls must be at least 2 (one failure never opens)")
        if self.window_s <= 0 or self.buckets < 1 or self.probes < 1 or self.open_s < 0:
            raise ValueError("window_s, buckets, probes must be positive and open_s >= 0")


class CircuitBreaker:
    """The state machine; :meth:`allow` before a call, :meth:`record` after it."""

    def __init__(self, clock: Clock, settings: BreakerSettings | None = None) -> None:
        self._clock = clock
        self.settings = settings or BreakerSettings()
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0
        self._probes_in_flight = 0
        self._probe_successes = 0
        self._slice = self.settings.window_s / self.settings.buckets
        # (slice index, calls, failures) per slot of a ring of ``buckets`` slots.
        self._ring: list[list[int]] = [[-1, 0, 0] for _ in range(self.settings.buckets)]
        self.opened_count = 0

    def configure(self, settings: BreakerSettings) -> None:
        """Apply new settings (a reload); the window restarts empty, the state is kept."""
        self.settings = settings
        self._slice = settings.window_s / settings.buckets
        self._ring = [[-1, 0, 0] for _ in range(settings.buckets)]

    @property
    def state(self) -> BreakerState:
        """The current state (an expired OPEN reads as HALF_OPEN)."""
        if (
            self._state is BreakerState.OPEN
            and self._clock.monotonic() - self._opened_at >= self.settings.open_s
        ):
            self._state = BreakerState.HALF_OPEN
            self._probes_in_flight = 0
            self._probe_successes = 0
        return self._state

    def allow(self) -> bool:
        """Whether a call may go to Redis now (a half-open probe is counted as taken)."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.OPEN:
            return False
        if self._probes_in_flight >= self.settings.probes:
            return False
        self._probes_in_flight += 1
        return True

    def record(self, ok: bool) -> None:
        """The outcome of a call :meth:`allow` let through."""
        state = self._state
        if state is BreakerState.HALF_OPEN:
            self._probes_in_flight = max(0, self._probes_in_flight - 1)
            if not ok:
                self._open()
                return
            self._probe_successes += 1
            if self._probe_successes >= self.settings.probes:
                self._state = BreakerState.CLOSED
                self._ring = [[-1, 0, 0] for _ in range(self.settings.buckets)]
            return
        if state is BreakerState.OPEN:
            return  # a call started before the breaker opened: its outcome changes nothing
        calls, failures = self._add(ok)
        s = self.settings
        if not ok and calls >= s.min_calls and failures >= s.failure_rate * calls:
            self._open()

    def reset(self) -> None:
        """Close now: the backend answered outside the probes (a new Redis master was found
        and caught up), so waiting out the cool-down would only refuse good calls."""
        self._state = BreakerState.CLOSED
        self._probes_in_flight = 0
        self._probe_successes = 0
        self._ring = [[-1, 0, 0] for _ in range(self.settings.buckets)]

    def abandon(self) -> None:
        """A call :meth:`allow` let through was cancelled before it had an outcome."""
        if self._state is BreakerState.HALF_OPEN:
            self._probes_in_flight = max(0, self._probes_in_flight - 1)

    def window(self) -> tuple[int, int]:
        """(calls, failures) in the rolling window now."""
        now_slice = int(self._clock.monotonic() / self._slice)
        oldest = now_slice - self.settings.buckets + 1
        calls = failures = 0
        for idx, c, f in self._ring:
            if idx >= oldest:
                calls += c
                failures += f
        return calls, failures

    def _add(self, ok: bool) -> tuple[int, int]:
        now_slice = int(self._clock.monotonic() / self._slice)
        slot = self._ring[now_slice % self.settings.buckets]
        if slot[0] != now_slice:
            slot[0], slot[1], slot[2] = now_slice, 0, 0
        slot[1] += 1
        if not ok:
            slot[2] += 1
        return self.window()

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = self._clock.monotonic()
        self._probes_in_flight = 0
        self._probe_successes = 0
        self.opened_count += 1
