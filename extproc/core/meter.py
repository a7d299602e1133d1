"""The per-stream meter: SSE bytes in, bytes to forward and charges to make out.

Sans-IO.  The servicer feeds each upstream body chunk to :meth:`StreamMeter.feed` and acts on
the returned :class:`Step`: forward ``step.forward`` to the client, ask the limiter for
``step.charge`` tokens when it is non-zero, and report the answer with
:meth:`StreamMeter.on_charge`.  When the limiter says the quota is gone the servicer calls
:meth:`StreamMeter.cut`, which returns the error event and ``[DONE]`` that end the stream.

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
from enum import Enum
from typing import Final

from extproc.core.apis.openai.stream import parse_event_data
from extproc.core.chunks import MalformedChunk, StreamChunk, Usage
from extproc.core.lifecycle import CutReason
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


class StreamPhase(Enum):
    """Where a metered stream is (the meter's only phase; the request's is its lifecycle)."""

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


class StreamMeter:
    """Meters one SSE response body."""

    __slots__ = (
        "_charge_in_flight",
        "_count",
        "_decoder",
        "_engine_counts",
        "_held",
        "_held_precharged",
        "_held_tokens",
        "_new_charge",
        "_read",
        "_strip_usage",
        "_terminal",
        "batch",
        "charged",
        "complete",
        "counted",
        "cut_reason",
        "delivered",
        "enforce",
        "events",
        "every",
        "exhausted",
        "lease",
        "leased_total",
        "malformed_events",
        "phase",
        "strict",
        "text_events",
        "uncharged",
        "upstream_error",
        "usage",
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
        self._count = count
        self._read = read
        self.every = every
        # Lazy batch size: N, shrunk to N/4 once a charge reports less than 16N left, so
        # streams near the limit learn about exhaustion sooner (a few more Redis calls, only
        # at the end of a window's budget).
        self.batch = every
        self.strict = strict
        self.enforce = enforce
        self._strip_usage = strip_usage
        # the engine reports its running output count in every chunk: charge by it (the
        # recount covers chunks that carry none)
        self._engine_counts = engine_counts
        self._decoder = SSEDecoder(max_event_bytes=max_event_bytes)
        self.lease = initial_lease
        self.leased_total = initial_lease
        self._held: deque[tuple[bytes, int, bool]] = deque()  # (event, tokens, terminal)
        self._held_tokens = 0
        self._charge_in_flight = 0
        self._held_precharged = 0  # held tokens the in-flight (lazy) charge already covers
        self._new_charge = 0
        self.uncharged = 0
        self.charged = 0
        self.delivered = 0
        self.counted = 0
        self.events = 0
        self.text_events = 0  # events carrying output text: each is at least one token
        self.malformed_events = 0
        self.exhausted = False
        self.phase = StreamPhase.OPEN
        # the API's terminal event ([DONE], response.completed, message_stop) reached the
        # client: the stream is complete whoever closes first
        self.complete = False
        self._terminal = False  # the event being inspected is the terminal one
        self.usage: Usage | None = None
        self.upstream_error: dict[str, object] | None = None
        self.cut_reason: CutReason | None = None

    # -- phase -----------------------------------------------------------------------------

    def _move(self, inp: StreamInput) -> None:
        self.phase = STREAM_TRANSITIONS[(self.phase, inp)]

    @property
    def upstream_done(self) -> bool:
        """The upstream's last byte arrived (or the stream was cut)."""
        return self.phase is not StreamPhase.OPEN

    @property
    def finished(self) -> bool:
        """The stream has ended: every event went out, or the gateway cut it."""
        return self.phase in (StreamPhase.FINISHED, StreamPhase.CUT)

    # -- feeding ---------------------------------------------------------------------------

    def _inspect(self, ev: SSEEvent) -> tuple[int, bool]:
        """Tokens in the event, and whether it is forwarded at all."""
        self.events += 1
        self._terminal = False
        data = ev.data
        if data is None:
            return 0, True
        try:
            chunk = self._read(ev.event, data)
        except MalformedChunk:
            # Forward unchanged (we are not the client's parser) but never undercharge it.
            self.malformed_events += 1
            return self._count(data), True
        # Usage and errors first: the Responses API's final event is both "done" and usage.
        if chunk.error is not None:
            self.upstream_error = chunk.error
        if chunk.usage is not None:
            self.usage = chunk.usage
        if chunk.done:
            self._terminal = True
            return 0, True
        tokens = 0
        if chunk.texts:
            self.text_events += 1
        if self._engine_counts and chunk.usage is not None:
            # the engine's running total, less what this stream has already been counted
            tokens = max(0, chunk.usage.completion_tokens - self.counted)
        else:
            for _, text in chunk.texts:
                if text:
                    tokens += self._count(text)
        if chunk.is_usage_only and self._strip_usage:
            return tokens, False
        return tokens, True

    def feed(self, chunk: bytes, end: bool) -> Step:
        """Take one upstream body chunk (``end`` on the last); return what to do."""
        if self.phase is not StreamPhase.OPEN and self.finished:
            return EMPTY
        if self.enforce and not self.strict and self.exhausted and not self.complete:
            return self._cut_step(CutReason.QUOTA_EXHAUSTED)
        try:
            events = self._decoder.feed(chunk) if chunk else []
            if end:
                events += self._decoder.flush()
        except SSEEventTooLarge:
            return self._cut_step(CutReason.EVENT_TOO_LARGE)
        out: list[bytes] = []
        enforce, strict = self.enforce, self.strict
        for ev in events:
            k, fwd = self._inspect(ev)
            self.counted += k
            if not fwd:
                continue
            if enforce and (self._held or self._must_hold(k)):
                self._held.append((ev.raw, k, self._terminal))
                self._held_tokens += k
                continue
            out.append(ev.raw)
            self.delivered += k
            if self._terminal:
                self.complete = True
            if enforce and strict:
                self.lease -= k
            else:
                self.uncharged += k
                if enforce and self._charge_in_flight == 0 and self.uncharged >= self.batch:
                    # Ask now, mid-chunk: a chunk carrying many events must not slip past
                    # the 2N cap just because the charge would only be asked after it.
                    self._charge_in_flight = self._new_charge = self.uncharged
        if end:
            self._move(StreamInput.UPSTREAM_END)
        # one event (the usual chunk): join returns its bytes without a copy
        return self._after(b"".join(out))

    def _must_hold(self, tokens: int) -> bool:
        """Strict: the event does not fit the lease.  Lazy: Redis has fallen a whole batch
        behind (a charge is in flight and 2N tokens are uncharged) — the safety valve that
        keeps lazy overshoot under 2N per stream even when Redis is slow."""
        if self.strict:
            return tokens > self.lease
        return tokens > 0 and self.uncharged + tokens > 2 * self.every

    def _after(self, out: bytes) -> Step:
        charge = 0
        blocked = False
        if self.enforce and self.strict:
            blocked = bool(self._held)
            need = self._held_tokens - self.lease
            if self._charge_in_flight == 0:
                if blocked:
                    charge = max(self.every, need)
                elif not self.upstream_done and self.lease * 2 < self.every and not self.exhausted:
                    charge = self.every
        elif self.enforce:
            blocked = bool(self._held)
            if blocked and self._charge_in_flight == 0:
                # Charge what passed and the held events before they go out.
                self._held_precharged = self._held_tokens
                charge = self.uncharged + self._held_tokens
                self._charge_in_flight = charge
                return Step(forward=out, charge=charge, blocked=True)
            if (
                self._charge_in_flight == 0
                and self.uncharged >= self.batch
                and not self.upstream_done
            ):
                self._new_charge = self.uncharged
            charge, self._new_charge = self._new_charge, 0
            if charge and self.upstream_done and not blocked:
                # The stream is over: settlement charges the remainder in one call.  (Not
                # when events are held: those wait for this charge, or they would pass the
                # 2N cap uncharged.)
                self._charge_in_flight = charge = 0
        if charge:
            self._charge_in_flight = charge
        elif not blocked and self.phase is StreamPhase.OPEN:
            return _forward_step(out)  # the common case: forward, nothing else
        end = self.upstream_done and not blocked
        if end:
            self._move(StreamInput.RELEASED)
        return Step(forward=out, end_stream=end, charge=charge, blocked=blocked)

    # -- limiter answers -------------------------------------------------------------------

    def on_charge(self, granted: int, exhausted: bool, room: int | None = None) -> Step:
        """Report the limiter's answer to the last requested charge (``room``: tokens the
        tightest bucket still has after it, when known)."""
        if room is not None and room < 16 * self.every:
            self.batch = max(1, self.every // 4)
        asked = self._charge_in_flight
        self._charge_in_flight = 0
        if self.finished:
            self.charged += granted
            return EMPTY
        if not self.strict:
            pre, self._held_precharged = self._held_precharged, 0
            self.charged += granted
            self.uncharged -= asked - pre
            if exhausted:
                self.exhausted = True
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
            if not pre and self.uncharged + self._held_tokens > 2 * self.every:
                # Held behind a batch charge, but too many to release uncharged: charge first.
                return self._after(b"")
            out = bytearray()
            while self._held:
                raw, k, terminal = self._held.popleft()
                self._held_tokens -= k
                self.delivered += k
                self.complete = self.complete or terminal
                covered = min(pre, k)
                pre -= covered
                self.uncharged += k - covered
                out += raw
            return self._after(bytes(out))
        self.charged += granted
        self.lease += granted
        self.leased_total += granted
        if exhausted or granted < asked:
            self.exhausted = True
        out = bytearray()
        while self._held and self._held[0][1] <= self.lease:
            raw, k, terminal = self._held.popleft()
            self._held_tokens -= k
            self.lease -= k
            self.delivered += k
            self.complete = self.complete or terminal
            out += raw
        if self._held and granted == 0:
            return self._cut_step(CutReason.QUOTA_EXHAUSTED, prefix=bytes(out))
        return self._after(bytes(out))

    def stop_enforcing(self) -> Step:
        """Fail-open: meter no more; release whatever was held and let the rest through."""
        self.enforce = False
        self._charge_in_flight = self._new_charge = self._held_precharged = 0
        out = bytearray()
        while self._held:
            raw, k, terminal = self._held.popleft()
            self.delivered += k
            self.complete = self.complete or terminal
            out += raw
        self._held_tokens = 0
        end = self.upstream_done and not self.finished
        if end:
            self._move(StreamInput.RELEASED)
        return Step(forward=bytes(out), end_stream=end)

    def on_charge_failed(self) -> None:
        """The limiter could not answer; the caller decides (fail open/closed)."""
        self._charge_in_flight = self._held_precharged = 0

    def fail(self, reason: CutReason) -> Step:
        """Fail closed: stop forwarding; the caller ends the stream with :meth:`cut`."""
        return self._cut_step(reason)

    @property
    def charge_in_flight(self) -> bool:
        """A charge was asked for and not yet answered."""
        return self._charge_in_flight != 0

    def _release(self, allowance: int, precharged: int) -> bytes:
        """Deliver held events, in order, while their tokens fit ``allowance`` (the rest is
        dropped by the cut that follows); the first ``precharged`` of them were charged."""
        out = bytearray()
        while self._held and self._held[0][1] <= allowance:
            raw, k, terminal = self._held.popleft()
            allowance -= k
            self._held_tokens -= k
            self.delivered += k
            covered = min(precharged, k)
            precharged -= covered
            self.uncharged += k - covered
            self.complete = self.complete or terminal
            out += raw
        return bytes(out)

    # -- ending ----------------------------------------------------------------------------

    def _cut_step(self, reason: CutReason, prefix: bytes = b"") -> Step:
        self.cut_reason = reason
        self._held.clear()
        self._held_tokens = 0
        return Step(forward=prefix, cut_reason=reason)

    def cut(self, final_events: bytes) -> bytes:
        """Finish the stream with ``final_events`` (the API's error event and terminator)."""
        self._move(StreamInput.CUT)
        if self.cut_reason is None:
            self.cut_reason = CutReason.QUOTA_EXHAUSTED
        self._held.clear()
        self._held_tokens = 0
        return final_events

    @property
    def unused_lease(self) -> int:
        """Leased tokens not delivered (refunded at settlement)."""
        return max(0, self.leased_total - self.delivered)
