"""Figures and trust: which upstream figures are believed, within which bounds around the
gateway's own count (:func:`bounded_output`, :func:`bounded_input`), how far a stream may run
ahead of its charges (:func:`run_ahead_budget`), and what an abandoned request could have
generated (:func:`abandoned_output`).  Sans-IO, pure functions of their arguments."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from extproc.core.admission_plan import Cost
from extproc.core.keys import WindowedBucket
from extproc.core.rules import RATE_SCALE


@dataclass(frozen=True, slots=True)
class Figure:
    """A trusted figure, and the disagreement (``low``/``high``) when the reported one was
    outside its bounds (``bound`` is then what is charged instead)."""

    value: int
    reported: int
    counted: int
    disagreement: Literal["low", "high"] | None = None
    bound: int = 0


# -- trusted figures -------------------------------------------------------------------------

#: A stream's reported output may be below the gateway's recount by this share plus the slack:
#: recounting each delta on its own finds more tokens than the engine generated (a delta is
#: one token whose text may re-tokenise as two). Measured against a real vLLM (docs/
#: engine-tests.md): +7-10 % on natural text from a real model, up to +26 % on a small random
#: model's free output; the events that carried text are a floor no report may go below.
OUTPUT_TOLERANCE = 0.30
OUTPUT_SLACK_TOKENS = 8
#: The upstream's input figure is trusted within this share (plus the slack) around the
#: gateway's count: the model's chat template frames messages differently from the OpenAI
#: formula the gateway falls back to (a few tokens per message either way).
INPUT_TOLERANCE = 0.25
INPUT_SLACK_TOKENS = 16
#: A chat template may add a default system prompt the gateway cannot see; above the count by
#: more than this (plus the tolerance) the figure is not trusted.
INPUT_TEMPLATE_ALLOWANCE = 64
#: Server-side state can add at most this much unseen input when the model sets no limit.
UNSEEN_INPUT_CEILING = 1_000_000
#: What an upstream generates per second per sequence, for requests abandoned before their
#: response: the default of a model's ``abandoned_tokens_per_second``.  A real engine (vLLM)
#: aborts a non-stream when Envoy resets it for a client that left, having generated for as
#: long as it ran (docs/engine-tests.md): the bill follows the time, not the reservation.
ABANDONED_TOKENS_PER_SECOND = 200


def bounded_output(reported: int, counted: int, high: int, *, floor: int = 0) -> Figure:
    """The upstream's output figure, trusted within ``[counted - tolerance, high]`` and never
    below ``floor`` (tokens known to have passed: one per event that carried text); outside,
    the nearest bound is charged (an upstream reporting nothing still pays what passed)."""
    low = max(0, floor, math.floor(counted * (1 - OUTPUT_TOLERANCE)) - OUTPUT_SLACK_TOKENS)
    low = min(low, high)
    if reported < low:
        return Figure(low, reported, counted, "low", low)
    if reported > high:
        return Figure(high, reported, counted, "high", high)
    return Figure(reported, reported, counted)


def run_ahead_budget(
    budget: int,
    *,
    buckets: tuple[WindowedBucket, ...],
    values: tuple[int, ...],
    cost: Cost,
    sequences: int,
) -> int:
    """The per-sequence output budget to forward so the engine cannot run far past the quota.

    An engine keeps generating while nobody reads its stream (measured: vLLM's generation
    counter went on at full speed behind a stalled reader), so a processor that lags cannot
    stop it by pausing; only a reset or the forwarded budget can. A stream is cut once its
    tenant's tightest per-token bucket is used up (lazy: within about one batch of N), so the
    upstream need never be allowed more than that room plus two batches: the client still sees
    the quota cut first, and what the engine computes beyond it is bounded."""
    if not cost.meter_stream or not cost.enforce_stream:
        return budget
    rooms = [
        (b.limit.limit - v) * RATE_SCALE // b.rates.output
        for b, v in zip(buckets, values, strict=True)
        if b.kind == "tpm" and not b.limit.shadow and b.rates.output > 0
    ]
    if not rooms:
        return budget
    room = max(0, min(rooms)) + cost.reserved_output + 2 * cost.every
    per_sequence = -(-room // max(1, sequences))
    return max(1, min(budget, per_sequence))


def bounded_input(reported: int, counted: int, *, unseen: bool, ceiling: int | None) -> Figure:
    """The upstream's input figure (``prompt_tokens``/``input_tokens``) within bounds around the
    gateway's own count (below them the count is charged, above them the upper bound); a
    request carrying server-side state the gateway cannot see
    (``previous_response_id``) may be charged the upstream's larger figure up to the model's
    input limit."""
    low = max(0, math.floor(counted * (1 - INPUT_TOLERANCE)) - INPUT_SLACK_TOKENS)
    if unseen:
        high = ceiling or UNSEEN_INPUT_CEILING
        high = max(high, counted)
    else:
        high = math.ceil(counted * (1 + INPUT_TOLERANCE)) + INPUT_TEMPLATE_ALLOWANCE
    if reported < low:
        # Below what any framing of the same prompt makes: the figure is not believed, and
        # the gateway's own count is charged (charging the low bound would leave an
        # under-reporting upstream a quarter of every prompt unbilled).
        return Figure(counted, reported, counted, "low", counted)
    if reported > high:
        return Figure(high, reported, counted, "high", high)
    return Figure(reported, reported, counted)


def abandoned_output(
    cost: Cost, sequences: int, elapsed_ms: int, rate: int = ABANDONED_TOKENS_PER_SECOND
) -> int:
    """Output an upstream could have generated for a request abandoned ``elapsed_ms`` after
    its admission, before its response, at ``rate`` tokens per second per sequence (rounded
    up): never more than was reserved."""
    per_second = max(0, rate) * max(1, sequences)
    return min(cost.reserved_output, -(-max(0, elapsed_ms) * per_second // 1000))
