"""The metered stream's phase machine (:class:`MeterPhase`): where the stream is
(:class:`StreamPhase`, moved by :data:`STREAM_TRANSITIONS`), what its charges still enforce
(:class:`Enforcement`), whether the API's terminal event reached the client and the cut's
reason.  One immutable value, replaced at each move, read by the meter
(:mod:`extproc.core.meter`) for every flag it shows.  Sans-IO."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from extproc.core.lifecycle import CutReason


class StreamPhase(Enum):
    """Where a metered stream is (the stream's side of the meter's phase; the request's is its
    lifecycle)."""

    OPEN = "open"  # the upstream is still sending
    UPSTREAM_DONE = "upstream_done"  # its last byte arrived; held events may still wait
    FINISHED = "finished"  # every event went out, the stream's end with them
    CUT = "cut"  # the gateway ended it (quota, backend, shutdown...)


class StreamInput(Enum):
    """What moves a stream's phase."""

    UPSTREAM_END = "upstream_end"  # the upstream's last body chunk
    RELEASED = "released"  # nothing is held any more after the upstream's end
    CUT = "cut"  # the gateway ends the stream


_P, _I = StreamPhase, StreamInput
#: Every (phase, input) pair: a stream ends once, by release or by cut, and stays ended.
STREAM_TRANSITIONS: dict[tuple[StreamPhase, StreamInput], StreamPhase] = {
    (_P.OPEN, _I.UPSTREAM_END): _P.UPSTREAM_DONE,
    (_P.OPEN, _I.RELEASED): _P.OPEN,  # released before the end: still open
    (_P.OPEN, _I.CUT): _P.CUT,
    (_P.UPSTREAM_DONE, _I.UPSTREAM_END): _P.UPSTREAM_DONE,
    (_P.UPSTREAM_DONE, _I.RELEASED): _P.FINISHED,
    (_P.UPSTREAM_DONE, _I.CUT): _P.CUT,
    (_P.FINISHED, _I.UPSTREAM_END): _P.FINISHED,
    (_P.FINISHED, _I.RELEASED): _P.FINISHED,
    (_P.FINISHED, _I.CUT): _P.FINISHED,  # it had ended: nothing left to cut
    (_P.CUT, _I.UPSTREAM_END): _P.CUT,
    (_P.CUT, _I.RELEASED): _P.CUT,
    (_P.CUT, _I.CUT): _P.CUT,
}


class Enforcement(Enum):
    """What the meter's charges still do (the quota's side of its phase)."""

    ENFORCED = "enforced"  # charges are asked as tokens pass; events may be held for them
    EXHAUSTED = "exhausted"  # a charge found the quota gone (strict: granted less than asked):
    # lazy cuts at the next event before the terminal one, strict renews no more early
    UNENFORCED = "unenforced"  # metering only (enforcement off, or fail-open after a limiter
    # failure): nothing held, nothing charged


@dataclass(frozen=True, slots=True)
class MeterPhase:
    """The meter's whole phase, one immutable value replaced at each move: where the stream
    is, what its charges still enforce (:class:`Enforcement`), whether the API's terminal
    event reached the client, and the cut's reason once one is decided.  Every flag the meter
    shows is read from it.

    Invariants (the moves keep them; a test checks them over event orders): an ended stream
    stays ended; ``CUT`` carries its reason; a stream that ``FINISHED`` was never cut; the
    first cut's reason stands; ``UNENFORCED`` is never left and ``EXHAUSTED`` is left only
    for it."""

    stream: StreamPhase = StreamPhase.OPEN
    enforcement: Enforcement = Enforcement.ENFORCED
    terminal_sent: bool = False
    cut_reason: CutReason | None = None

    @property
    def ended(self) -> bool:
        """Every event went out, or the gateway cut the stream."""
        return self.stream is StreamPhase.FINISHED or self.stream is StreamPhase.CUT

    def move(self, inp: StreamInput) -> MeterPhase:
        """The stream's own moves (:data:`STREAM_TRANSITIONS`); a cut names its reason (the
        quota's, when none was decided before)."""
        to = STREAM_TRANSITIONS[(self.stream, inp)]
        if to is self.stream:
            return self
        if to is StreamPhase.FINISHED and self.cut_reason is not None:
            return self  # a decided cut ends it: released, it still waits for that cut
        if to is StreamPhase.CUT:
            return replace(self, stream=to, cut_reason=self.cut_reason or CutReason.QUOTA_EXHAUSTED)
        return replace(self, stream=to)

    def decide_cut(self, reason: CutReason) -> MeterPhase:
        """The meter (or the caller, failing closed) decided to cut: the first reason stands;
        a finished stream has nothing left to cut."""
        if self.cut_reason is not None or self.stream is StreamPhase.FINISHED:
            return self
        return replace(self, cut_reason=reason)

    def exhaust(self) -> MeterPhase:
        """A charge found the quota gone (meaningless once unenforced)."""
        if self.enforcement is Enforcement.ENFORCED:
            return replace(self, enforcement=Enforcement.EXHAUSTED)
        return self

    def unenforce(self) -> MeterPhase:
        """Meter without charging from now on (fail-open)."""
        if self.enforcement is Enforcement.UNENFORCED:
            return self
        return replace(self, enforcement=Enforcement.UNENFORCED)

    def terminal(self) -> MeterPhase:
        """The API's terminal event reached the client."""
        return self if self.terminal_sent else replace(self, terminal_sent=True)
