"""The per-stream meter: SSE bytes in, bytes to forward and charges to make out.

Sans-IO.  The metered stream (:mod:`extproc.core.streaming`) feeds each upstream body chunk to
:meth:`StreamMeter.feed` and acts on the returned :class:`Step`: forward ``step.forward`` to the
client, ask the limiter for ``step.charge`` tokens when it is non-zero, and report the answer
with :meth:`StreamMeter.on_charge`.  When the stream is cut (the quota gone, the processor
shutting down, ...) it calls :meth:`StreamMeter.cut` with the API's cut event, which the meter
returns as the stream's last bytes: one error event and nothing after it (no ``[DONE]``, no
``message_stop``; :mod:`extproc.core.apis.errors`), after which the server aborts the
response.

Tokens are the engine's own running count when it reports one in every chunk
(``engine_counts``: vLLM's ``continuous_usage_stats``), otherwise the recount of each delta.

Two ways to charge output (``strict`` flag):

* **lazy** — forward every complete event at once; each time N uncharged tokens have passed,
  ask for a charge of them.  When a charge leaves a bucket over its limit, the next chunk is
  not forwarded: the stream is cut.  Uncharged tokens never exceed 2N: an event that would
  take them past 2N (a merged chunk of many tokens, or Redis falling a batch behind) is held
  and charged *before* it is forwarded, and dropped (the stream cut) if that charge finds the
  quota gone.  Overshoot: at most 2N per concurrent stream, N in the common case.
* **strict** — forward only what a lease covers.  The lease (initially what admission
  reserved) is renewed early, when less than half of N is left, so the stream rarely waits;
  an event that does not fit is held until the renewal answers.  A renewal granting nothing
  cuts the stream.  Tokens delivered never exceed what was leased.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Final

from extproc.core.apis.openai.stream import parse_event_data
from extproc.core.chunks import MalformedChunk, StreamChunk, Usage
from extproc.core.lifecycle import CutReason
from extproc.core.meter_phase import (
    UPSTREAM_OPEN,
    Enforcement,
    MeterPhase,
    StreamInput,
    StreamPhase,
)
from extproc.core.sse import SSEDecoder, SSEEvent, SSEEventTooLarge


def _openai_read(event: str | None, data: str) -> StreamChunk:
    return parse_event_data(data)


@dataclass(frozen=True, slots=True)
class Step:
    """What the servicer must do after a feed or a charge answer."""

    forward: bytes = b""
    end_stream: bool = False
    charge: int = 0
    blocked: bool = False
    cut_reason: CutReason | None = None


EMPTY = Step()

_STEP_FIELDS: Final = ("forward", "end_stream", "charge", "blocked", "cut_reason")
if tuple(f.name for f in fields(Step)) != _STEP_FIELDS:  # pragma: no cover - guards an edit
    raise RuntimeError("Step fields changed: update _STEP_FIELDS and _forward_step")
_new_object: Final = object.__new__
_set_forward, _set_end, _set_charge, _set_blocked, _set_cut = (
    Step.__dict__[name].__set__ for name in _STEP_FIELDS
)


def _forward_step(forward: bytes) -> Step:
    """``Step(forward=forward)`` without the frozen dataclass ``__init__`` (the per-chunk
    result: fills the slots directly)."""
    step: Step = _new_object(Step)
    _set_forward(step, forward)
    _set_end(step, False)
    _set_charge(step, 0)
    _set_blocked(step, False)
    _set_cut(step, None)
    return step


@dataclass(slots=True)
class StreamStats:
    """What the meter saw, for settlement, logs and tests (never read to decide anything)."""

    events: int = 0
    text_events: int = 0  # events carrying output text: each is at least one token
    malformed_events: int = 0
    leased_total: int = 0  # the initial lease and every strict grant before the end
    usage: Usage | None = None  # the upstream's own figures, last reported
    upstream_error: dict[str, object] | None = None  # an in-stream error object


_OPEN: Final = StreamPhase.OPEN
_UPSTREAM_DONE: Final = StreamPhase.UPSTREAM_DONE  # and no cut decided: a release ends it
_ENFORCED: Final = Enforcement.ENFORCED
_EXHAUSTED: Final = Enforcement.EXHAUSTED
_UNENFORCED: Final = Enforcement.UNENFORCED


class StreamMeter:
    """Meters one SSE response body.

    Its state: the phase (:class:`MeterPhase`), the strict lease, the tokens uncharged,
    charged, delivered and counted, the held events and the charge in flight (with the part
    of the held tokens it covers).  The rest is configuration, one tuning value (the lazy
    batch) and statistics (:class:`StreamStats`); the flags (``complete``, ``exhausted``,
    ``enforce``, ``cut_reason``, ``finished``, ``upstream_done``) are read off the phase."""

    __slots__ = (
        "_charge_in_flight",
        "_count",
        "_decoder",
        "_engine_counts",
        "_held",
        "_held_precharged",
        "_read",
        "_strip_usage",
        "batch",
        "charged",
        "counted",
        "delivered",
        "every",
        "lease",
        "phase",
        "stats",
        "strict",
        "uncharged",
    )

    def __init__(
        self,
        *,
        count: Callable[[str], int],
        every: int,
        strict: bool,
        enforce: bool = True,
        initial_lease: int = 0,
        strip_usage: bool = False,
        max_event_bytes: int = 1 << 20,
        read: Callable[[str | None, str], StreamChunk] = _openai_read,
        engine_counts: bool = False,
    ) -> None:
        # configuration
        self._count = count
        self._read = read
        self.every = every
        self.strict = strict
        self._strip_usage = strip_usage
        # the engine reports its running output count in every chunk: charge by it (the
        # recount covers chunks that carry none)
        self._engine_counts = engine_counts
        self._decoder = SSEDecoder(max_event_bytes=max_event_bytes)
        # Lazy batch size: N, shrunk to N/4 once a charge reports less than 16N left, so
        # streams near the limit learn about exhaustion sooner (a few more Redis calls, only
        # at the end of a window's budget).
        self.batch = every
        # state
        self.phase = MeterPhase(enforcement=_ENFORCED if enforce else _UNENFORCED)
        self.lease = initial_lease
        self.uncharged = 0
        self.charged = 0
        self.delivered = 0
        self.counted = 0
        self._held: deque[tuple[bytes, int, bool]] = deque()  # (event, tokens, terminal)
        self._charge_in_flight = 0
        self._held_precharged = 0  # held tokens the in-flight (lazy) charge already covers
        self.stats = StreamStats(leased_total=initial_lease)

    # -- phase: every flag is read off it ---------------------------------------------------

    @property
    def upstream_done(self) -> bool:
        """The upstream's last byte arrived (or the stream was cut)."""
        return self.phase.stream not in UPSTREAM_OPEN

    @property
    def finished(self) -> bool:
        """The stream has ended: every event went out, or the gateway cut it."""
        return self.phase.ended

    @property
    def complete(self) -> bool:
        """The API's terminal event ([DONE], response.completed, message_stop) reached the
        client: the stream is complete whoever closes first."""
        return self.phase.terminal_sent

    @property
    def exhausted(self) -> bool:
        """A charge found the quota gone (while enforcing)."""
        return self.phase.enforcement is _EXHAUSTED

    @property
    def enforce(self) -> bool:
        """Charges are asked and events held for them (not metering only)."""
        return self.phase.enforcement is not _UNENFORCED

    @property
    def cut_reason(self) -> CutReason | None:
        """Why the stream is (to be) cut; None while it is not."""
        return self.phase.cut_reason

    @property
    def held_tokens(self) -> int:
        """Tokens in the events held."""
        return sum(k for _, k, _ in self._held)

    def _delivered(self, k: int, terminal: bool) -> None:
        self.delivered += k
        if terminal:
            self.phase = self.phase.terminal()

    # -- feeding ---------------------------------------------------------------------------

    def _inspect(self, ev: SSEEvent) -> tuple[int, bool, bool]:
        """Tokens in the event, whether it is forwarded at all, and whether it is the API's
        terminal event."""
        stats = self.stats
        stats.events += 1
        data = ev.data
        if data is None:
            return 0, True, False
        try:
            chunk = self._read(ev.event, data)
        except MalformedChunk:
            # Forward unchanged (we are not the client's parser) but never undercharge it.
            stats.malformed_events += 1
            return self._count(data), True, False
        # Usage and errors first: the Responses API's final event is both "done" and usage.
        if chunk.error is not None:
            stats.upstream_error = chunk.error
        if chunk.usage is not None:
            stats.usage = chunk.usage
        if chunk.done:
            return 0, True, True
        tokens = 0
        if chunk.texts:
            stats.text_events += 1
        if self._engine_counts and chunk.usage is not None:
            # the engine's running total, less what this stream has already been counted
            tokens = max(0, chunk.usage.completion_tokens - self.counted)
        else:
            for _, text in chunk.texts:
                if text:
                    tokens += self._count(text)
        if chunk.is_usage_only and self._strip_usage:
            return tokens, False, False
        return tokens, True, False

    def feed(self, chunk: bytes, end: bool) -> Step:
        """Take one upstream body chunk (``end`` on the last); return what to do."""
        phase = self.phase
        if phase.stream is not _OPEN and phase.ended:
            return EMPTY
        enforcement = phase.enforcement
        if enforcement is _EXHAUSTED and not self.strict and not phase.terminal_sent:
            return self._cut_step(CutReason.QUOTA_EXHAUSTED)
        try:
            events = self._decoder.feed(chunk) if chunk else []
            if end:
                events += self._decoder.flush()
        except SSEEventTooLarge:
            return self._cut_step(CutReason.EVENT_TOO_LARGE)
        out: list[bytes] = []
        enforce, strict = enforcement is not _UNENFORCED, self.strict
        new_charge = 0
        held = self._held
        for ev in events:
            k, fwd, terminal = self._inspect(ev)
            self.counted += k
            if not fwd:
                continue
            if enforce and (held or self._must_hold(k)):
                held.append((ev.raw, k, terminal))
                continue
            out.append(ev.raw)
            self.delivered += k
            if terminal:
                self.phase = self.phase.terminal()
            if enforce and strict:
                self.lease -= k
            else:
                self.uncharged += k
                if enforce and self._charge_in_flight == 0 and self.uncharged >= self.batch:
                    # Ask now, mid-chunk: a chunk carrying many events must not slip past
                    # the 2N cap just because the charge would only be asked after it.
                    self._charge_in_flight = new_charge = self.uncharged
        if end:
            self.phase = self.phase.move(StreamInput.UPSTREAM_END)
        # one event (the usual chunk): join returns its bytes without a copy
        return self._after(b"".join(out), new_charge)

    def _must_hold(self, tokens: int) -> bool:
        """Strict: the event does not fit the lease.  Lazy: Redis has fallen a whole batch
        behind (a charge is in flight and 2N tokens are uncharged) — the safety valve that
        keeps lazy overshoot under 2N per stream even when Redis is slow."""
        if self.strict:
            return tokens > self.lease
        return tokens > 0 and self.uncharged + tokens > 2 * self.every

    def _after(self, out: bytes, new_charge: int = 0) -> Step:
        """The step after events passed or were held (``new_charge``: a lazy charge ``feed``
        already asked for mid-chunk)."""
        charge = 0
        blocked = False
        phase = self.phase
        enforcement = phase.enforcement
        if enforcement is not _UNENFORCED and self.strict:
            blocked = bool(self._held)
            if self._charge_in_flight == 0:
                if blocked:
                    charge = max(self.every, self.held_tokens - self.lease)
                elif (
                    phase.stream in UPSTREAM_OPEN
                    and self.lease * 2 < self.every
                    and enforcement is not _EXHAUSTED
                ):
                    charge = self.every
        elif enforcement is not _UNENFORCED:
            blocked = bool(self._held)
            if blocked and self._charge_in_flight == 0:
                # Charge what passed and the held events before they go out.
                held = self._held_precharged = self.held_tokens
                charge = self.uncharged + held
                self._charge_in_flight = charge
                return Step(forward=out, charge=charge, blocked=True)
            if (
                self._charge_in_flight == 0
                and self.uncharged >= self.batch
                and phase.stream in UPSTREAM_OPEN
            ):
                new_charge = self.uncharged
            charge = new_charge
            if charge and phase.stream not in UPSTREAM_OPEN and not blocked:
                # The stream is over: settlement charges the remainder in one call.  (Not
                # when events are held: those wait for this charge, or they would pass the
                # 2N cap uncharged.)
                self._charge_in_flight = charge = 0
        if charge:
            self._charge_in_flight = charge
        elif not blocked and phase.stream is _OPEN:
            return _forward_step(out)  # the common case: forward, nothing else
        end = phase.stream is _UPSTREAM_DONE and not blocked  # (a decided cut ends it else)
        if end:
            self.phase = phase.move(StreamInput.RELEASED)
        return Step(forward=out, end_stream=end, charge=charge, blocked=blocked)

    # -- limiter answers -------------------------------------------------------------------

    def on_charge(self, granted: int, exhausted: bool, room: int | None = None) -> Step:
        """Report the limiter's answer to the last requested charge (``room``: tokens the
        tightest bucket still has after it, when known)."""
        if room is not None and room < 16 * self.every:
            self.batch = max(1, self.every // 4)
        asked = self._charge_in_flight
        self._charge_in_flight = 0
        self.charged += granted
        if self.phase.ended:
            return EMPTY
        if not self.strict:
            pre, self._held_precharged = self._held_precharged, 0
            self.uncharged -= asked - pre
            if exhausted:
                self.phase = self.phase.exhaust()
                if self.enforce and self._held:
                    # Deliver the held events the quota still covers (the charge included
                    # ``pre`` of them; ``room`` is what the tightest bucket has left after
                    # it), then cut: a backlog is delivered up to the quota, not dropped.
                    released = self._release(pre + (room or 0), pre)
                    if self._held:
                        return self._cut_step(CutReason.QUOTA_EXHAUSTED, prefix=released)
                    # the whole backlog fitted: the stream goes on and is cut at its next
                    # event, as any lazy stream that ran out
                    return self._after(released)
            if not pre and self.uncharged + self.held_tokens > 2 * self.every:
                # Held behind a batch charge, but too many to release uncharged: charge first.
                return self._after(b"")
            return self._after(self._release(None, pre))
        self.lease += granted
        self.stats.leased_total += granted
        if exhausted or granted < asked:
            self.phase = self.phase.exhaust()
        out = bytearray()
        held = self._held
        while held and held[0][1] <= self.lease:
            raw, k, terminal = held.popleft()
            self.lease -= k
            self._delivered(k, terminal)
            out += raw
        if held and granted == 0:
            return self._cut_step(CutReason.QUOTA_EXHAUSTED, prefix=bytes(out))
        return self._after(bytes(out))

    def stop_enforcing(self) -> Step:
        """Fail-open: meter no more; release whatever was held and let the rest through."""
        self.phase = self.phase.unenforce()
        self._charge_in_flight = self._held_precharged = 0
        out = bytearray()
        held = self._held
        while held:
            raw, k, terminal = held.popleft()
            self._delivered(k, terminal)
            out += raw
        phase = self.phase
        end = phase.stream is _UPSTREAM_DONE
        if end:
            self.phase = phase.move(StreamInput.RELEASED)
        return Step(forward=bytes(out), end_stream=end)

    def on_charge_failed(self) -> None:
        """The limiter could not answer; the caller decides (fail open/closed)."""
        self._charge_in_flight = self._held_precharged = 0

    def fail(self, reason: CutReason) -> Step:
        """Fail closed: stop forwarding; the caller ends the stream with :meth:`cut`."""
        return self._cut_step(reason)

    def _release(self, allowance: int | None, precharged: int) -> bytes:
        """Deliver held events, in order, while their tokens fit ``allowance`` (None: all of
        them; the rest is dropped by the cut that follows); the first ``precharged`` of them
        were charged, the others join the uncharged."""
        out = bytearray()
        held = self._held
        while held and (allowance is None or held[0][1] <= allowance):
            raw, k, terminal = held.popleft()
            if allowance is not None:
                allowance -= k
            self._delivered(k, terminal)
            covered = min(precharged, k)
            precharged -= covered
            self.uncharged += k - covered
            out += raw
        return bytes(out)

    # -- ending ----------------------------------------------------------------------------

    def _cut_step(self, reason: CutReason, prefix: bytes = b"") -> Step:
        self.phase = self.phase.decide_cut(reason)
        self._held.clear()
        return Step(forward=prefix, cut_reason=reason)

    def cut(self, final_events: bytes) -> bytes:
        """Finish the stream with ``final_events`` (the API's cut event: an error event, no
        terminator after it)."""
        self.phase = self.phase.move(StreamInput.CUT)
        self._held.clear()
        return final_events
