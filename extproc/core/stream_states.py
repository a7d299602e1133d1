"""The metered stream's states (:class:`StreamState`) and what its wait states resume with once
the server answers: data, not closures (:mod:`extproc.core.streaming` holds the machine and
its transition table).  Sans-IO."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from extproc.core import stream_vocabulary as sv
from extproc.core.meter import Step


@dataclass(frozen=True, slots=True)
class FeedNext:
    """Then meter this chunk (it came with a charge's answer), unless the stream ended."""

    data: bytes
    end: bool


#: What follows a step once it may go on: nothing more, or the chunk still to meter.
Then = FeedNext | None


@dataclass(frozen=True, slots=True)
class ApplyStep:
    """Apply the meter's ``step`` (unless the stream ended meanwhile), then ``then``."""

    step: Step
    then: Then


@dataclass(frozen=True, slots=True)
class ForwardTerminal:
    """Forward the terminal event with the final figures (``unless_ended``: not when the stream
    was cut meanwhile: that cut said it all)."""

    data: bytes
    unless_ended: bool


@dataclass(frozen=True, slots=True)
class CutCorrupt:
    """Cut the stream for a corrupt compressed body; ``late``: the side actions of a charge's
    answer that came with it."""

    late: tuple[sv.StreamAction, ...]


#: What resumes once the exact input count is taken.
Resume = ApplyStep | ForwardTerminal | CutCorrupt


class StreamState(Enum):
    """Where a metered stream is."""

    __hash__ = object.__hash__  # as lifecycle.State's: looked up per event

    METERING = "metering"  # chunks pass through the meter (a charge may be in flight)
    AWAITING_CHARGE = "awaiting_charge"  # sv.AwaitCharge is out: events are held until it answers
    AWAITING_COUNT = "awaiting_count"  # sv.CountInput is out: sv.CountDone comes next
    ENDED = "ended"  # the response is over (completed, cut, answered by the gateway)


#: What a wait state resumes with once its answer comes: the chunk still to meter (charge) or
#: what waited for the count.
Pending = Then | Resume
