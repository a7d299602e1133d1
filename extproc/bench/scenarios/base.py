"""What a benchmark scenario is, and the stacks scenarios run on.

A scenario is one ``--only``/``--skip`` section: a name and an ``async`` measure function that
adds rows to the run's table and figures to its raw JSON.  Scenarios marked ``on_main`` share
one main stack (Redis, simulator, one real processor, one Envoy with the filtered listener and
a baseline listener without the filter); the others start the stacks they need themselves
through :meth:`Stacks.start`, which keeps them for the final clean-up.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.bench import system
from extproc.bench.plan import Bench
from extproc.stack import Stack


@dataclass
class Stacks:
    """The stacks of one run: the shared main stack while it is up, and every stack started."""

    workdir: Path
    rules: dict[str, Any]
    started: list[Stack] = field(default_factory=list)
    main: Stack | None = None

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
