"""What a benchmark scenario is, and the stacks scenarios run on.

A scenario is one ``--only``/``--skip`` section: a name and an ``async`` measure function that
adds rows to the run's table and figures to its raw JSON.  Scenarios marked ``on_main`` share
one main stack (Redis, simulator, one real processor, one Envoy with the filtered listener and
a baseline listener without the filter) and, when one asks for it, the do-nothing floor stack
(:meth:`Stacks.shared_floor`); the others start the stacks they need themselves
through :meth:`Stacks.start`, which keeps them for the final clean-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.bench import system
from extproc.bench.client import Shape
from extproc.bench.drivers import KEY, batch
from extproc.bench.plan import Bench
from extproc.stack import Stack


@dataclass
class Stacks:
    """The stacks of one run: the shared main stack while it is up, and every stack started."""

    workdir: Path
    rules: dict[str, Any]
    started: list[Stack] = field(default_factory=list)
    main: Stack | None = None
    floor: Stack | None = None

    async def start(self, name: str, **options: Any) -> Stack:
        """Start a stack under ``workdir/name`` with the run's rules (``options`` as
        :func:`extproc.bench.system.start_stack` takes them) and keep it for :meth:`stop_all`."""
        stack = await asyncio.to_thread(
            system.start_stack, self.workdir / name, self.rules, **options
        )
        self.started.append(stack)
        return stack

    @property
    def shared(self) -> Stack:
        """The main stack (only while the ``on_main`` scenarios run)."""
        if self.main is None:
            raise RuntimeError("the main stack is not running")
        return self.main

    async def shared_floor(self) -> Stack:
        """The do-nothing floor stack (:mod:`extproc.bench.floor` behind its own Envoy, sharing
        the main stack's Redis), started and warmed on first use; it lives as long as the main
        stack."""
        if self.floor is None:
            self.floor = await self.start(
                "floor",
                extproc_argv=(sys.executable, "-m", "extproc.bench.floor"),
                redis_url=self.shared.effective_redis_url,
            )
            url = self.floor.base_url
            await batch(url, KEY, Shape(stream=True, max_tokens=20), count=20, concurrency=4)
            await batch(url, KEY, Shape(), count=30, concurrency=4)
        return self.floor

    def stop_shared(self) -> None:
        """Stop the floor stack (if started) and the main stack."""
        if self.floor is not None:
            self.floor.stop()
            self.floor = None
        if self.main is not None:
            self.main.stop()
            self.main = None

    @property
    def baseline_url(self) -> str:
        """The main Envoy's listener without the filter."""
        return f"http://127.0.0.1:{self.shared.baseline_port}/v1"

    def stop_all(self) -> None:
        """Stop every stack started, newest first (errors ignored: this is the clean-up)."""
        for s in reversed(self.started):
            with contextlib.suppress(Exception):
                s.stop()


@dataclass(frozen=True)
class Scenario:
    """One section of the suite."""

    name: str
    measure: Callable[[Bench, Stacks], Awaitable[None]]
    #: runs on the shared main stack (started once for all such scenarios)
    on_main: bool = False
