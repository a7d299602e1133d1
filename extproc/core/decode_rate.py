"""What a model's upstream generates per second per sequence, and how long it takes to start,
learned from its completed streams: what an abandoned request is billed where the gateway
could not meter it (a non-stream on the JSON path, ``non_streams: json``, or one whose
upstream answered with JSON although asked for a stream).  Sans-IO arithmetic, bounded memory.

An observation is one completed response.  One the gateway saw arrive chunk by chunk (a
stream, or a non-stream on the exact path) gives its time to the first chunk (admission to
first body chunk: queueing, prefill, the network) and its decode rate (output tokens per
sequence over first chunk to end); a JSON response gives a decode rate only, over admission
to end less the model's learned time to start (a model whose traffic is all JSON learns too).
Each model keeps its last :data:`WINDOW` of each; once :data:`MIN_SAMPLES` were made the rate
is their median (one outlier moves it by nothing; the short window follows the engine's speed
as its load changes) and the start their shortest (:meth:`RateWindow.start_ms`: a start is
the caller's to lengthen, never to shorten).  The rates of JSON responses and of chunked ones
are also kept apart (the last :data:`WINDOW` of each kind): an abandoned non-stream is billed
at the median of the model's JSON responses once it has :data:`MIN_SAMPLES` of them, an
abandoned stream at its chunked ones', either at the median of both kinds until then.  An
engine does not decode both at one speed: measured with the CPU vLLM on 2 cores, a stream
10-17 % slower than a non-stream (its per-token SSE work shares the cores with the model).  An abandon ``t`` ms after admission is billed
``rate * (t - start)`` per sequence (:meth:`DecodeRates.abandon`): measured with vLLM, a
rate over the whole time (admission to end) billed 8-11 % under what the engine generated
after 2 s and 28 % over after 0.5 s, the start being ~0.1 s.  Before a model has enough
observations its configured ``abandoned_tokens_per_second`` stands, with no start.
Responses too short to say anything (fewer than :data:`MIN_TOKENS` tokens per sequence, or a
decode under :data:`MIN_MS`) are not observed.
"""

from __future__ import annotations

from collections import deque
from typing import Final

#: Observations kept per model (the newest).
WINDOW: Final = 9
#: Observations a model needs before its learned figures replace its configured rate.
MIN_SAMPLES: Final = 5
#: A response with fewer output tokens per sequence than this, or decoding for less than
#: MIN_MS, is not observed: its rate would be mostly noise.
MIN_TOKENS: Final = 32
MIN_MS: Final = 100
#: Models remembered at once (the oldest-observed is forgotten past this; models come from the
#: rules file, so this is only a guard).
MAX_MODELS: Final = 4096


def observed_rate(tokens: int, sequences: int, decode_ms: int) -> float | None:
    """Tokens per second per sequence of one response, None when it is too short to count."""
    per_sequence = tokens / max(1, sequences)
    if per_sequence < MIN_TOKENS or decode_ms < MIN_MS:
        return None
    return per_sequence * 1000 / decode_ms


def _median(values: deque[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


class RateWindow:
    """One model's last :data:`WINDOW` observations: decode rates (of both kinds, and of JSON
    and chunked responses apart) and times to start."""

    __slots__ = ("_chunked", "_json", "_rates", "_starts")

    def __init__(self) -> None:
        self._rates: deque[float] = deque(maxlen=WINDOW)
        self._json: deque[float] = deque(maxlen=WINDOW)
        self._chunked: deque[float] = deque(maxlen=WINDOW)
        self._starts: deque[float] = deque(maxlen=WINDOW)

    def observe(self, rate: float, start_ms: float | None = 0.0) -> None:
        """Keep one observation (the oldest goes past :data:`WINDOW`); ``start_ms`` None: a
        rate only (a JSON response: no first chunk seen)."""
        self._rates.append(rate)
        if start_ms is None:
            self._json.append(rate)
        else:
            self._chunked.append(rate)
            self._starts.append(max(0.0, start_ms))

    def _window(self, json: bool | None) -> deque[float]:
        """The rates of JSON responses (``json``) or of chunked ones (not ``json``) once there
        are :data:`MIN_SAMPLES` of that kind; both kinds before that, and for None."""
        if json is None:
            return self._rates
        own = self._json if json else self._chunked
        return own if len(own) >= MIN_SAMPLES else self._rates

    def __len__(self) -> int:
        return len(self._rates)

    def samples(self, json: bool | None = None) -> int:
        """Observations :meth:`rate` reads for ``json``."""
        return len(self._window(json))

    def rate(self, json: bool | None = None) -> int | None:
        """The median observed rate (of JSON responses for ``json``, of chunked ones for
        False, once there are :data:`MIN_SAMPLES` of that kind; else of both), rounded up, once
        :data:`MIN_SAMPLES` were made."""
        rates = self._window(json)
        if len(rates) < MIN_SAMPLES:
            return None
        return max(1, -int(-_median(rates) // 1))

    def start_ms(self) -> int:
        """The shortest time to the first chunk kept, rounded down (0 before
        :data:`MIN_SAMPLES`): not the median, because a caller decides how long a start takes
        (a long prompt's prefill) — a tenant sending a few long-prompt streams would otherwise
        raise the start every abandon is billed after, and abandon short-prompt non-streams
        unbilled; nobody can make a start shorter than the engine makes it."""
        if len(self._starts) < MIN_SAMPLES:
            return 0
        return int(min(self._starts))


class DecodeRates:
    """The learned figures of every model (one process's memory: each replica learns its
    own, and starts again from the configured rate after a restart)."""

    __slots__ = ("_models",)

    def __init__(self) -> None:
        self._models: dict[str, RateWindow] = {}

    def observe(
        self, model: str, tokens: int, sequences: int, decode_ms: int, start_ms: int | None = 0
    ) -> None:
        """One completed response of ``model``: its output, its decode time (first chunk to
        end) and its time to the first chunk (None: a JSON response, whose decode time is
        admission to end less :meth:`start_ms`)."""
        rate = observed_rate(tokens, sequences, decode_ms)
        if rate is None:
            return
        window = self._models.pop(model, None)  # re-inserted: the dict's order is recency
        if window is None:
            window = RateWindow()
            if len(self._models) >= MAX_MODELS:
                del self._models[next(iter(self._models))]
        window.observe(rate, start_ms)
        self._models[model] = window

    def rate(self, model: str, default: int) -> int:
        """``model``'s decode rate: learned, else ``default``."""
        window = self._models.get(model)
        learned = window.rate() if window is not None else None
        return default if learned is None else learned

    def abandon(self, model: str, default: int, *, json: bool | None = None) -> tuple[int, int]:
        """(rate, start ms) an abandoned request of ``model`` is billed at: learned (``json``:
        a non-stream, rated by the model's JSON responses once it has enough of them; False: a
        stream, by its chunked ones), else ``default`` with no start."""
        window = self._models.get(model)
        learned = window.rate(json) if window is not None else None
        if window is None or learned is None:
            return default, 0
        return learned, window.start_ms()

    def start_ms(self, model: str) -> int:
        """``model``'s learned time to start (0 before it has enough observations)."""
        window = self._models.get(model)
        return window.start_ms() if window is not None else 0

    def samples(self, model: str, *, json: bool | None = None) -> int:
        """Observations kept for ``model`` (those :meth:`abandon` reads for ``json``)."""
        window = self._models.get(model)
        return window.samples(json) if window is not None else 0
