"""Live, single-line progress display on stderr (plain text, redrawn at most 4 times/s)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class Counters:
    """Live counters updated by the runner and read by the progress line."""

    started_mono: float = field(default_factory=time.monotonic)
    done: int = 0
    in_flight: int = 0
    refused: int = 0
    cut: int = 0
    failed: int = 0
    output_tokens: int = 0


def format_line(c: Counters, now: float | None = None) -> str:
    """The progress line for counters ``c`` at monotonic time ``now``."""
    elapsed = max((time.monotonic() if now is None else now) - c.started_mono, 1e-9)
    return (
        f"[{elapsed:7.1f}s] done {c.done}  in-flight {c.in_flight}  429 {c.refused}  "
        f"cut {c.cut}  failed {c.failed}  out {c.output_tokens / elapsed:.0f} tok/s"
    )


class ProgressLine:
    """Redraws one line on ``stream``; ``render`` is rate-limited to ``max_hz``."""

    def __init__(
        self, counters: Counters, stream: TextIO | None = None, max_hz: float = 4.0
    ) -> None:
        """Remember where to draw and how often."""
        self.counters = counters
        self.stream = stream or sys.stderr
        self.min_interval = 1.0 / max_hz
        self._last = 0.0
        self._width = 0

    def render(self, force: bool = False) -> None:
        """Redraw the line unless the last redraw was less than ``1/max_hz`` s ago."""
        now = time.monotonic()
        if not force and now - self._last < self.min_interval:
            return
        self._last = now
        line = format_line(self.counters, now)
        pad = max(0, self._width - len(line))
        self._width = len(line)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()

    def close(self) -> None:
        """Draw the final state and end the line."""
        self.render(force=True)
        self.stream.write("\n")
        self.stream.flush()
