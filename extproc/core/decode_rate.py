"""What a model's upstream generates per second per sequence, learned from its completed
responses: the rate an abandoned request is billed at where the gateway could not meter it
(an upstream that answered a non-stream with JSON instead of a stream, or a model on
``non_streams: json``).  Sans-IO arithmetic, bounded memory.

An observation is one completed metered response: its output tokens per sequence over the
milliseconds from its admission to its end (the time to the first token included, as it is
in an abandoned request's elapsed time, which the rate multiplies).  Each model keeps its
last :data:`WINDOW` observations; its rate is their median once :data:`MIN_SAMPLES` were
made (one slow or fast outlier moves it by nothing), before that the model's configured
``abandoned_tokens_per_second``.  Responses too short to say anything (fewer than
:data:`MIN_TOKENS` tokens per sequence, or under :data:`MIN_MS`) are not observed.
"""

from __future__ import annotations

from collections import deque
from typing import Final

#: Observations kept per model (the newest).
WINDOW: Final = 64
#: Observations a model needs before its learned rate replaces its configured one.
MIN_SAMPLES: Final = 5
#: A response with fewer output tokens per sequence than this, or shorter than MIN_MS, is not
#: observed: its time is mostly the time to its first token.
MIN_TOKENS: Final = 32
MIN_MS: Final = 100
#: Models remembered at once (the oldest-observed is forgotten past this; models come from the
#: rules file, so this is only a guard).
MAX_MODELS: Final = 4096


def observed_rate(tokens: int, sequences: int, elapsed_ms: int) -> float | None:
    """Tokens per second per sequence of one response, None when it is too short to count."""
    per_sequence = tokens / max(1, sequences)
    if per_sequence < MIN_TOKENS or elapsed_ms < MIN_MS:
        return None
    return per_sequence * 1000 / elapsed_ms


class RateWindow:
    """One model's last :data:`WINDOW` observed rates."""

    __slots__ = ("_rates",)

    def __init__(self) -> None:
        self._rates: deque[float] = deque(maxlen=WINDOW)

    def observe(self, rate: float) -> None:
        """Keep one observed rate (the oldest goes past :data:`WINDOW`)."""
        self._rates.append(rate)

    def __len__(self) -> int:
        return len(self._rates)

    def rate(self) -> int | None:
        """The median observed rate, rounded up, once :data:`MIN_SAMPLES` were made."""
        n = len(self._rates)
        if n < MIN_SAMPLES:
            return None
        ordered = sorted(self._rates)
        mid = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
        return max(1, -int(-mid // 1))


class DecodeRates:
    """The learned rates of every model (one process's memory: each replica learns its own)."""

    __slots__ = ("_models",)

    def __init__(self) -> None:
        self._models: dict[str, RateWindow] = {}

    def observe(self, model: str, tokens: int, sequences: int, elapsed_ms: int) -> None:
        """One completed response of ``model``."""
        rate = observed_rate(tokens, sequences, elapsed_ms)
        if rate is None:
            return
        window = self._models.pop(model, None)  # re-inserted: the dict's order is recency
        if window is None:
            window = RateWindow()
            if len(self._models) >= MAX_MODELS:
                del self._models[next(iter(self._models))]
        window.observe(rate)
        self._models[model] = window

    def rate(self, model: str, default: int) -> int:
        """The rate to bill ``model``'s abandoned requests at: learned, else ``default``."""
        window = self._models.get(model)
        learned = window.rate() if window is not None else None
        return default if learned is None else learned

    def samples(self, model: str) -> int:
        """Observations kept for ``model``."""
        window = self._models.get(model)
        return len(window) if window is not None else 0
