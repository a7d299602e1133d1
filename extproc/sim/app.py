"""aiohttp application of the upstream simulator: generation APIs, fault injection, ground truth.

The routes are in :mod:`extproc.sim.routes`, the delivery engine that writes answers on the
wire in :mod:`extproc.sim.delivery`, the ground-truth records in :mod:`extproc.sim.records`.
"""

from __future__ import annotations

import structlog
from aiohttp import web

from extproc.sim.config import SimConfig
from extproc.sim.records import RecordStore
from extproc.sim.routes import add_routes
from extproc.sim.state import STATE_KEY, SimState
from extproc.sim.text import vocabulary

log = structlog.get_logger(__name__)

__all__ = ["make_app", "start_sim"]


def make_app(config: SimConfig) -> web.Application:
    """Build the simulator application (verifies the token vocabulary eagerly)."""
    vocabulary()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[STATE_KEY] = SimState(config=config, store=RecordStore(config.max_records))
    add_routes(app)
    return app


async def start_sim(config: SimConfig) -> tuple[web.AppRunner, int]:
    """Serve the simulator on ``config.host:config.port`` (0 = any free port).

    Returns the runner (call ``await runner.cleanup()`` to stop) and the bound port.
    """
    app = make_app(config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(
        runner, config.host, config.port, reuse_address=True, reuse_port=config.reuse_port or None
    )
    await site.start()
    port = int(runner.addresses[0][1])
    log.info("sim_listening", host=config.host, port=port, models=list(config.models))
    return runner, port
