"""OpenAI-compatible upstream simulator (``ai-quota sim``).

A deterministic fake model server that streams token-exact text, injects latency and faults on
request, and keeps per-request ground truth (tokens actually written, how the request ended).
"""

from __future__ import annotations

from extproc.sim.app import make_app, start_sim
from extproc.sim.config import SimConfig

__all__ = ["SimConfig", "make_app", "start_sim"]
