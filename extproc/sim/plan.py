"""How long the simulator's answer is and why it ends (:func:`plan_answer`): the request's
max-tokens limit, the ``x-sim-*`` overrides and the simulator's configuration (pure, no I/O).
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.sim.config import SimConfig
from extproc.sim.controls import SimControls
from extproc.sim.request import GenerationRequest


@dataclass(frozen=True, slots=True)
class Plan:
    """How long each choice's answer is and why it ends."""

    limit: int
    tokens_per_choice: int
    finish_reason: str


def plan_answer(req: GenerationRequest, controls: SimControls, config: SimConfig) -> Plan:
    """Answer length per choice: the max-tokens limit, or ``x-sim-tokens`` when shorter.

    Without a limit in the request the answer has ``default_tokens`` tokens, or, with
    ``x-sim-ignore-max-tokens``, the rest of the context (``context_tokens - prompt_tokens``,
    not capped by ``max_tokens_cap``), like a real vLLM.

    ``finish_reason`` is "length" when the answer is cut by an explicit max_tokens limit,
    "tool_calls" for tool-call answers, else "stop".
    """
    context_run = False
    if req.requested_max_tokens is not None:
        limit = min(req.requested_max_tokens, config.max_tokens_cap)
    elif controls.ignore_max_tokens:
        # a real vLLM without max_tokens generates up to the end of the context window
        limit = max(0, config.context_tokens - req.prompt_tokens)
        context_run = True
    else:
        limit = config.default_tokens
    tokens = limit if controls.tokens is None else min(controls.tokens, limit)
    if controls.tool_call:
        reason = "tool_calls"
    elif (req.requested_max_tokens is not None or context_run) and tokens >= limit:
        reason = "length"
    else:
        reason = "stop"
    return Plan(limit=limit, tokens_per_choice=tokens, finish_reason=reason)
