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
    """The real clock; ``offset_ms`` shifts its wall time (drills and tests of window and
    month boundaries: ``AIQ_CLOCK_OFFSET_MS``), never its monotonic time."""

    def __init__(self, offset_ms: int = 0) -> None:
        self.offset_ms = offset_ms

    def now_ms(self) -> int:
        """Unix time in milliseconds (plus the offset)."""
        return time.time_ns() // 1_000_000 + self.offset_ms

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
