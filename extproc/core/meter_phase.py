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

    __hash__ = object.__hash__  # as lifecycle.State's: looked up per move

    OPEN = "open"  # the upstream is still sending
    UPSTREAM_DONE = "upstream_done"  # its last byte arrived; held events may still wait
    OPEN_CUTTING = "open_cutting"  # a cut is decided (not yet made); the upstream still sends
    DONE_CUTTING = "done_cutting"  # a cut is decided, the upstream's last byte arrived: the
    # stream ends by that cut, not by releasing what it holds
    FINISHED = "finished"  # every event went out, the stream's end with them
    CUT = "cut"  # the gateway ended it (quota, backend, shutdown...)


class StreamInput(Enum):
    """What moves a stream's phase."""

    __hash__ = object.__hash__

    UPSTREAM_END = "upstream_end"  # the upstream's last body chunk
    RELEASED = "released"  # nothing is held any more after the upstream's end
    DECIDE_CUT = "decide_cut"  # the meter (or the caller, failing closed) decides to cut
    CUT = "cut"  # the gateway ends the stream


_P, _I = StreamPhase, StreamInput
#: Every (phase, input) pair: a stream ends once, by release or by cut, and stays ended; a
#: decided cut is the way it ends (a release after it waits for that cut).
STREAM_TRANSITIONS: dict[tuple[StreamPhase, StreamInput], StreamPhase] = {
    (_P.OPEN, _I.UPSTREAM_END): _P.UPSTREAM_DONE,
    (_P.OPEN, _I.RELEASED): _P.OPEN,  # released before the end: still open
    (_P.OPEN, _I.DECIDE_CUT): _P.OPEN_CUTTING,
    (_P.OPEN, _I.CUT): _P.CUT,
    (_P.UPSTREAM_DONE, _I.UPSTREAM_END): _P.UPSTREAM_DONE,
    (_P.UPSTREAM_DONE, _I.RELEASED): _P.FINISHED,
    (_P.UPSTREAM_DONE, _I.DECIDE_CUT): _P.DONE_CUTTING,
    (_P.UPSTREAM_DONE, _I.CUT): _P.CUT,
    (_P.OPEN_CUTTING, _I.UPSTREAM_END): _P.DONE_CUTTING,
    (_P.OPEN_CUTTING, _I.RELEASED): _P.OPEN_CUTTING,
    (_P.OPEN_CUTTING, _I.DECIDE_CUT): _P.OPEN_CUTTING,  # the first reason stands
    (_P.OPEN_CUTTING, _I.CUT): _P.CUT,
    (_P.DONE_CUTTING, _I.UPSTREAM_END): _P.DONE_CUTTING,
    (_P.DONE_CUTTING, _I.RELEASED): _P.DONE_CUTTING,  # it still waits for the cut
    (_P.DONE_CUTTING, _I.DECIDE_CUT): _P.DONE_CUTTING,
    (_P.DONE_CUTTING, _I.CUT): _P.CUT,
    (_P.FINISHED, _I.UPSTREAM_END): _P.FINISHED,
    (_P.FINISHED, _I.RELEASED): _P.FINISHED,
    (_P.FINISHED, _I.DECIDE_CUT): _P.FINISHED,  # it had ended: nothing left to cut
    (_P.FINISHED, _I.CUT): _P.FINISHED,
    (_P.CUT, _I.UPSTREAM_END): _P.CUT,
    (_P.CUT, _I.RELEASED): _P.CUT,
    (_P.CUT, _I.DECIDE_CUT): _P.CUT,
    (_P.CUT, _I.CUT): _P.CUT,
}
#: The upstream still sends (a cut decided or not).
UPSTREAM_OPEN = frozenset((_P.OPEN, _P.OPEN_CUTTING))
#: A cut is decided or made: the phase carries its reason (and only then).
CUTTING = frozenset((_P.OPEN_CUTTING, _P.DONE_CUTTING, _P.CUT))


class Enforcement(Enum):
    """What the meter's charges still do (the quota's side of its phase)."""

    __hash__ = object.__hash__

    ENFORCED = "enforced"  # charges are asked as tokens pass; events may be held for them
    EXHAUSTED = "exhausted"  # a charge found the quota gone (strict: granted less than asked):
    # lazy cuts at the next event before the terminal one, strict renews no more early
    UNENFORCED = "unenforced"  # metering only (enforcement off, or fail-open after a limiter
    # failure): nothing held, nothing charged


class EnforcementInput(Enum):
    """What moves the enforcement."""

    __hash__ = object.__hash__

    EXHAUSTED = "exhausted"  # a charge found the quota gone
    FAILED_OPEN = "failed_open"  # the limiter failed and the plan fails open


_E, _EI = Enforcement, EnforcementInput
#: Every (enforcement, input) pair: unenforced is never left, exhausted only for it.
ENFORCEMENT_TRANSITIONS: dict[tuple[Enforcement, EnforcementInput], Enforcement] = {
    (_E.ENFORCED, _EI.EXHAUSTED): _E.EXHAUSTED,
    (_E.ENFORCED, _EI.FAILED_OPEN): _E.UNENFORCED,
    (_E.EXHAUSTED, _EI.EXHAUSTED): _E.EXHAUSTED,
    (_E.EXHAUSTED, _EI.FAILED_OPEN): _E.UNENFORCED,
    (_E.UNENFORCED, _EI.EXHAUSTED): _E.UNENFORCED,  # meaningless once unenforced
    (_E.UNENFORCED, _EI.FAILED_OPEN): _E.UNENFORCED,
}


@dataclass(frozen=True, slots=True)
class MeterPhase:
    """The meter's whole phase, one immutable value replaced at each move: where the stream
    is, what its charges still enforce (:class:`Enforcement`), whether the API's terminal
    event reached the client, and the cut's reason once one is decided.  Every flag the meter
    shows is read from it.

    Every move is a transition table's (:data:`STREAM_TRANSITIONS`,
    :data:`ENFORCEMENT_TRANSITIONS`).  Invariants (the tables keep them; a test checks them
    over event orders): an ended stream stays ended; the reason is set exactly in the cutting
    phases (:data:`CUTTING`) and the first one stands; a stream that ``FINISHED`` was never
    cut; ``UNENFORCED`` is never left and ``EXHAUSTED`` is left only for it."""

    stream: StreamPhase = StreamPhase.OPEN
    enforcement: Enforcement = Enforcement.ENFORCED
    terminal_sent: bool = False
    cut_reason: CutReason | None = None

    @property
    def ended(self) -> bool:
        """Every event went out, or the gateway cut the stream."""
        return self.stream is StreamPhase.FINISHED or self.stream is StreamPhase.CUT

    def move(self, inp: StreamInput, reason: CutReason | None = None) -> MeterPhase:
        """The stream's move by :data:`STREAM_TRANSITIONS`, the only rule of where it goes; a
        decided cut carries ``reason`` (the first stands: the table stays put), a cut made
        without one names the quota."""
        to = STREAM_TRANSITIONS[(self.stream, inp)]
        if to is self.stream:
            return self
        if to is StreamPhase.CUT:
            return replace(self, stream=to, cut_reason=self.cut_reason or CutReason.QUOTA_EXHAUSTED)
        if inp is StreamInput.DECIDE_CUT:
            return replace(self, stream=to, cut_reason=reason or CutReason.QUOTA_EXHAUSTED)
        return replace(self, stream=to)

    def decide_cut(self, reason: CutReason) -> MeterPhase:
        """The meter (or the caller, failing closed) decided to cut (:data:`STREAM_TRANSITIONS`:
        the first reason stands; a finished stream has nothing left to cut)."""
        return self.move(StreamInput.DECIDE_CUT, reason)

    def enforcing(self, inp: EnforcementInput) -> MeterPhase:
        """The enforcement's move by :data:`ENFORCEMENT_TRANSITIONS`."""
        to = ENFORCEMENT_TRANSITIONS[(self.enforcement, inp)]
        return self if to is self.enforcement else replace(self, enforcement=to)

    def exhaust(self) -> MeterPhase:
        """A charge found the quota gone (meaningless once unenforced)."""
        return self.enforcing(EnforcementInput.EXHAUSTED)

    def unenforce(self) -> MeterPhase:
        """Meter without charging from now on (fail-open)."""
        return self.enforcing(EnforcementInput.FAILED_OPEN)

    def terminal(self) -> MeterPhase:
        """The API's terminal event reached the client."""
        return self if self.terminal_sent else replace(self, terminal_sent=True)
