"""The ``x-sim-*`` control headers (pure, no I/O): per-request overrides of the simulator's
timing, length, faults and usage reporting (:class:`SimControls`, :func:`parse_controls`), and the
usage lie of ``x-sim-usage`` (:class:`UsageLie`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from extproc.sim.request import RequestError


@dataclass(frozen=True, slots=True)
class UsageLie:
    """``x-sim-usage``: what the final usage reports instead of the real output-token count."""

    mode: str  # "fixed" | "scale" | "absent"
    value: float = 0.0

    def reported(self, real: int) -> int | None:
        """The output-token count to report for ``real`` generated tokens (None = omit usage)."""
        if self.mode == "absent":
            return None
        if self.mode == "scale":
            return max(0, round(real * self.value))
        return int(self.value)


@dataclass(frozen=True, slots=True)
class SimControls:
    """Per-request overrides read from ``x-sim-*`` headers (None = not given)."""

    tokens: int | None = None
    seed: int | None = None
    ttft_ms: float | None = None
    itl_ms: float | None = None
    tokens_per_chunk: int | None = None
    status: int | None = None
    disconnect_after: int | None = None
    slow_start_ms: float | None = None
    malformed_after: int | None = None
    error_event_after: int | None = None
    reasoning: int = 0
    tool_call: bool = False
    chunk_tokens: int | None = None
    burst_tokens: int | None = None
    gzip: bool = False
    honour_accept_encoding: bool = False
    content_type: str | None = None
    usage: UsageLie | None = None
    # x-sim-prompt-usage: what the usage reports instead of the real prompt-token count (an
    # upstream that under-reports its input, e.g. scale:0.04)
    prompt_usage: UsageLie | None = None
    ignore_max_tokens: bool = False
    content_length: bool = False

    @property
    def per_chunk(self) -> int | None:
        """Tokens per streamed event asked by the headers (burst > chunk > tokens-per-chunk)."""
        return self.burst_tokens or self.chunk_tokens or self.tokens_per_chunk


def _header_int(headers: Mapping[str, str], name: str, minimum: int = 0) -> int | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise RequestError(400, f"header {name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise RequestError(400, f"header {name} must be >= {minimum}, got {value}")
    return value


def _header_ms(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        raise RequestError(400, f"header {name} must be a number, got {raw!r}") from None
    if not value >= 0 or value == float("inf"):
        raise RequestError(400, f"header {name} must be a finite number >= 0")
    return value


def parse_controls(headers: Mapping[str, str]) -> SimControls:
    """Read the ``x-sim-*`` headers (``headers`` keys must be lower-case)."""
    status = _header_int(headers, "x-sim-status")
    if status is not None and not 400 <= status <= 599:
        raise RequestError(400, "header x-sim-status must be an HTTP error status (400-599)")
    content_type = headers.get("x-sim-content-type")
    if content_type is not None:
        content_type = content_type.strip()
        if not content_type or any(c in content_type for c in "\r\n"):
            raise RequestError(400, "header x-sim-content-type must be a value or 'none'")
    return SimControls(
        tokens=_header_int(headers, "x-sim-tokens"),
        seed=_header_int(headers, "x-sim-seed", minimum=-(2**63)),
        ttft_ms=_header_ms(headers, "x-sim-ttft-ms"),
        itl_ms=_header_ms(headers, "x-sim-itl-ms"),
        tokens_per_chunk=_header_int(headers, "x-sim-tokens-per-chunk", minimum=1),
        status=status,
        disconnect_after=_header_int(headers, "x-sim-disconnect-after"),
        slow_start_ms=_header_ms(headers, "x-sim-slow-start-ms"),
        malformed_after=_header_int(headers, "x-sim-malformed-after"),
        error_event_after=_header_int(headers, "x-sim-error-event-after"),
        reasoning=_header_int(headers, "x-sim-reasoning") or 0,
        tool_call=_header_flag(headers, "x-sim-tool-call"),
        chunk_tokens=_header_int(headers, "x-sim-chunk-tokens", minimum=1),
        burst_tokens=_header_int(headers, "x-sim-burst-tokens", minimum=1),
        gzip=_header_flag(headers, "x-sim-gzip"),
        honour_accept_encoding=_header_flag(headers, "x-sim-honour-accept-encoding"),
        content_type=content_type,
        usage=parse_usage_lie(headers.get("x-sim-usage")),
        prompt_usage=parse_usage_lie(
            headers.get("x-sim-prompt-usage"), name="x-sim-prompt-usage", absent=False
        ),
        ignore_max_tokens=_header_flag(headers, "x-sim-ignore-max-tokens"),
        content_length=_header_flag(headers, "x-sim-content-length"),
    )


_TRUE = ("1", "true", "yes", "on")


def _header_flag(headers: Mapping[str, str], name: str) -> bool:
    return headers.get(name, "").strip().lower() in _TRUE


def parse_usage_lie(
    raw: str | None, *, name: str = "x-sim-usage", absent: bool = True
) -> UsageLie | None:
    """``x-sim-usage``: ``<int>`` (report that count), ``scale:<float>`` or ``absent``
    (``x-sim-prompt-usage``, ``absent=False``: the first two only)."""
    if raw is None:
        return None
    value = raw.strip().lower()
    if value == "absent" and absent:
        return UsageLie("absent")
    forms = "<int>, scale:<float> or absent" if absent else "<int> or scale:<float>"
    try:
        if value.startswith("scale:"):
            factor = float(value.removeprefix("scale:"))
            if not factor >= 0 or factor == float("inf"):
                raise ValueError(value)
            return UsageLie("scale", factor)
        count = int(value)
    except ValueError:
        raise RequestError(400, f"header {name} must be {forms}, got {raw!r}") from None
    if count < 0:
        raise RequestError(400, f"header {name} must be >= 0")
    return UsageLie("fixed", float(count))
