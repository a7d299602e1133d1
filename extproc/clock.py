"""An injectable clock: wall time for windows, monotonic time for durations."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """What the gateway asks of time."""

    def now_ms(self) -> int:
        """Unix time in milliseconds (windows are aligned to it)."""
        ...

    def monotonic(self) -> float:
        """Seconds from an arbitrary origin, for latencies and cool-downs."""
        ...


class SystemClock:
    """The real clock."""

    def now_ms(self) -> int:
        """Unix time in milliseconds."""
        return time.time_ns() // 1_000_000

    def monotonic(self) -> float:
        """``time.monotonic()``."""
        return time.monotonic()


class FakeClock:
    """A clock tests move by hand."""

    def __init__(self, now_ms: int = 1_700_000_000_000) -> None:
        self._now_ms = now_ms
        self._mono = 0.0

    def now_ms(self) -> int:
        """The current fake Unix time in ms."""
        return self._now_ms

    def monotonic(self) -> float:
        """The current fake monotonic time."""
        return self._mono

    def advance(self, seconds: float) -> None:
        """Move both clocks forward."""
        self._now_ms += int(seconds * 1000)
        self._mono += seconds
