"""The simulator's process-wide state (configuration and ground-truth records), as the aiohttp
application holds it."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from extproc.sim.config import SimConfig
from extproc.sim.records import RecordStore


@dataclass(slots=True)
class SimState:
    """Process-wide simulator state shared by all handlers."""

    config: SimConfig
    store: RecordStore


STATE_KEY = web.AppKey("ai_quota_sim_state", SimState)
