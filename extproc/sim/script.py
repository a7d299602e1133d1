"""The byte script of one streamed response, built before anything is sent (pure, no I/O).

Because the simulator is deterministic, a whole stream (events, their timing, the tokens each
carries, injected faults and how it ends) is known in advance. Building it first lets the
simulator send a ``Content-Length`` for a stream, gzip it chunk by chunk, or send it in one
burst, while the sender only sleeps, writes and records what reached the socket.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from extproc.sim.controls import UsageLie
from extproc.sim.wire.base import REASONING, Encoder, Unit, UsageReport

#: how a scripted stream ends
END_EOF = "eof"
END_ABORT = "abort"
END_ERROR_EVENT = "error_event"


@dataclass(slots=True)
class Frame:
    """One write: ``data`` at ``at`` seconds after the first-token time, carrying ``tokens``."""

    data: bytes
    tokens: int = 0
    at: float = 0.0
    note: str | None = None
    #: set on the frame that carries the final usage: the output count it reports
    usage_reported: int | None = None


@dataclass(slots=True)
class Script:
    """All frames of a stream and how it ends."""

    frames: list[Frame]
    end: str
    output_tokens: int
    reasoning_tokens: int
    usage_reported: int | None = None


@dataclass(slots=True)
class Triggers:
    """Injection points, in output tokens written (counted over all choices)."""

    malformed: int | None = None
    error_event: int | None = None
    disconnect: int | None = None
    fired: set[str] = field(default_factory=set)

    def _pending(self) -> list[tuple[str, int]]:
        pairs = (
            ("malformed", self.malformed),
            ("error_event", self.error_event),
            ("disconnect", self.disconnect),
        )
        return [(n, t) for n, t in pairs if t is not None and n not in self.fired]

    def next_cap(self, sent: int) -> int | None:
        """Tokens that may still be sent before the next injection point (None = no limit)."""
        caps = [t - sent for _, t in self._pending() if t > sent]
        return min(caps) if caps else None

    def due(self, sent: int, end_of_content: bool) -> list[str]:
        """Injections to fire now, in the order malformed, error_event, disconnect."""
        return [n for n, t in self._pending() if sent >= t or end_of_content]


@dataclass(slots=True)
class _ChoiceState:
    index: int
    units: list[Unit]
    pos: int = 0

    @property
    def done(self) -> bool:
        return self.pos >= len(self.units)


def build_stream(
    encoder: Encoder,
    choices: list[list[Unit]],
    *,
    per_chunk: int,
    interval: float,
    first_chunk: int | None = None,
    triggers: Triggers,
    usage_for: UsageFunc,
) -> Script:
    """Script a stream: opening events, content chunks interleaved over choices, closing.

    A chunk holds up to ``per_chunk`` tokens of one kind and never straddles an injection point;
    chunks of step ``k`` are at ``k * interval``; ``first_chunk``, when set, caps each choice's
    first chunk (vLLM sends the first token at once whatever its ``stream_interval``).
    ``usage_for(output, reasoning)`` turns the real counts into the usage to report.
    """
    frames: list[Frame] = [Frame(b) for b in encoder.opening()]
    states = [_ChoiceState(i, units) for i, units in enumerate(choices)]
    sent = 0
    reasoning = 0

    def fire(at: float, end_of_content: bool) -> str | None:
        for name in triggers.due(sent, end_of_content):
            triggers.fired.add(name)
            if name == "malformed":
                frames.append(Frame(encoder.malformed_event(), at=at, note="malformed"))
            elif name == "error_event":
                frames.append(Frame(encoder.error_event(), at=at, note="error_event"))
                return END_ERROR_EVENT
            else:
                return END_ABORT
        return None

    end = fire(0.0, end_of_content=False)
    step = 0
    at = 0.0
    while end is None and not all(s.done for s in states):
        at = step * interval
        step += 1
        for st in states:
            if st.done:
                continue
            cap = triggers.next_cap(sent)
            limit = per_chunk if first_chunk is None or step > 1 else first_chunk
            limit = limit if cap is None else min(limit, cap)
            kind = st.units[st.pos].kind
            taken: list[Unit] = []
            tokens = 0
            while st.pos < len(st.units) and st.units[st.pos].kind == kind and tokens < limit:
                unit = st.units[st.pos]
                taken.append(unit)
                tokens += unit.tokens
                st.pos += 1
            events = encoder.delta(st.index, "".join(u.text for u in taken), kind)
            frames += [Frame(e, at=at) for e in events[:-1]]
            frames.append(Frame(events[-1], tokens=tokens, at=at))
            sent += tokens
            if kind == REASONING:
                reasoning += tokens
            end = fire(at, end_of_content=False)
            if end is not None:
                break
    if end is None:
        end = fire(at, end_of_content=True)
    usage = usage_for(sent, reasoning)
    if end is None:
        end = END_EOF
        closing = encoder.closing(usage)
        frames += [Frame(e, at=at) for e in closing]
        if usage.output is not None and _closing_has_usage(encoder):
            frames[-1].usage_reported = usage.output
    return Script(
        frames=frames,
        end=end,
        output_tokens=sent,
        reasoning_tokens=reasoning,
        usage_reported=frames[-1].usage_reported if end == END_EOF else None,
    )


def _closing_has_usage(encoder: Encoder) -> bool:
    return encoder.api not in ("chat", "completions") or encoder.ctx.include_usage


class UsageFunc:
    """Maps the real (output, reasoning) counts to the usage the simulator reports."""

    def __init__(self, lie: UsageLie | None = None) -> None:
        self._lie = lie

    def __call__(self, output: int, reasoning: int) -> UsageReport:
        reported = output if self._lie is None else self._lie.reported(output)
        return UsageReport(output=reported, reasoning=reasoning)


def burst(frames: list[Frame]) -> list[Frame]:
    """All frames merged into one write at the first-token time (tokens and usage kept)."""
    if not frames:
        return frames
    merged = Frame(
        b"".join(f.data for f in frames),
        tokens=sum(f.tokens for f in frames),
        note=",".join(f.note for f in frames if f.note) or None,
        usage_reported=next(
            (f.usage_reported for f in frames if f.usage_reported is not None), None
        ),
    )
    return [merged]


class Gzip:
    """A gzip stream flushed per chunk (``Z_SYNC_FLUSH``) so each write is decodable at once."""

    def __init__(self) -> None:
        self._z = zlib.compressobj(wbits=31)

    def chunk(self, data: bytes) -> bytes:
        """Compressed bytes for ``data``, flushed."""
        return self._z.compress(data) + self._z.flush(zlib.Z_SYNC_FLUSH)

    def finish(self) -> bytes:
        """The end of the gzip stream (final block and trailer)."""
        return self._z.flush(zlib.Z_FINISH)
