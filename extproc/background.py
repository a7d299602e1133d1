"""What runs beside the requests of one process, in the background: the input shortcut's stops
shared with the other replicas through Redis (:class:`InputStops`) and the exact input counts of
requests admitted on a bound on their way to their open ledgers (:class:`InputNotes`).  Each is
owned by the :class:`~extproc.gateway.Gateway` and reads its limiter, rules and metrics; a
request only hands them work (a stop found, a note) and never waits for them."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from typing import Any, Protocol, cast

import orjson
import structlog

from extproc.clock import Clock
from extproc.config.runtime import RuntimeConfig
from extproc.core.audits import InputAudits
from extproc.core.keys import input_stops_key
from extproc.errors import LimiterUnavailable
from extproc.limiter.base import InputNote, InputNoter, InputStopStore, Limiter
from extproc.metrics import Metrics

log = structlog.get_logger("extproc")

#: How often each replica reads the models whose input shortcut another replica stopped (one
#: HKEYS of one small hash per replica per period, off the requests' path), and writes the
#: stops it found that Redis did not take yet.
INPUT_STOPS_REFRESH_S = 1.0
#: How long a config version's stops live in Redis after the last one was found (a version
#: no replica runs any more is forgotten).
INPUT_STOPS_TTL_MS = 30 * 86_400_000

#: Input notes waiting for their call at most (beyond, a note is dropped: the bound stays).
MAX_INPUT_NOTES = 10_000
#: How long a note waits for others to share its call.
INPUT_NOTE_TICK_S = 0.005


class Host(Protocol):
    """What the background jobs read of their owner (the process's
    :class:`~extproc.gateway.Gateway`)."""

    limiter: Limiter
    config: RuntimeConfig
    config_version: str
    clock: Clock
    metrics: Metrics
    key_prefix: str
    instance: str
    input_audits: InputAudits

    def track(self, task: asyncio.Task[Any]) -> None: ...


class InputStops:
    """The input shortcut's stops, shared by every replica through Redis."""

    __slots__ = ("_gw", "_loop", "_seen", "_unsent")

    def __init__(self, gw: Host) -> None:
        self._gw = gw
        # stops found here that Redis has not taken yet: (config version, model) -> what was found
        self._unsent: dict[tuple[str, str], str] = {}
        # writes them and reads the other replicas' every INPUT_STOPS_REFRESH_S while requests
        # are admitted on a bound (an idle replica makes no call)
        self._loop: asyncio.Task[None] | None = None
        self._seen = False

    def bound_seen(self) -> None:
        """A request was admitted on a bound: keep the shared stops fresh."""
        self._seen = True
        if self._loop is None:
            self.keep()

    def _store(self) -> InputStopStore | None:
        if getattr(self._gw.limiter, "input_stops", None) is None:
            return None
        return cast("InputStopStore", self._gw.limiter)

    def stop(self, model: str, found: dict[str, Any]) -> None:
        """A count here contradicted ``model``'s upstream input figure (the shortcut already
        stopped in this process): write it to Redis for every replica, at once in the
        background, and again at each refresh until Redis takes it."""
        version = self._gw.config_version
        entry = {
            **found,
            "model": model,
            "config_version": version,
            "replica": self._gw.instance,
            "at_ms": self._gw.clock.now_ms(),
        }
        self._unsent[(version, model)] = orjson.dumps(entry).decode()
        if self._store() is not None:
            self._gw.track(asyncio.ensure_future(self._write()))
            self.keep()  # retries what Redis did not take

    async def _write(self) -> None:
        store = self._store()
        if store is None:
            return
        for (version, model), entry in list(self._unsent.items()):
            key = input_stops_key(self._gw.key_prefix, version)
            try:
                first = await store.stop_input_shortcut(key, model, entry, INPUT_STOPS_TTL_MS)
            except LimiterUnavailable:
                log.warning("input_shortcut_stop_not_written", model=model, retry_in_s=1.0)
                return
            self._unsent.pop((version, model), None)
            log.info("input_shortcut_stop_written", model=model, first=first)

    async def refresh(self) -> list[str]:
        """Write the stops found here that Redis did not take yet, then read those of this
        config version (any replica's, this one's before a restart): the models this stopped
        here now.  One HKEYS; a Redis that does not answer changes nothing (the probation and
        this process's own audits still hold)."""
        store = self._store()
        if store is None:
            return []
        if self._unsent:
            await self._write()
        version = self._gw.config_version
        try:
            names = await store.input_stops(input_stops_key(self._gw.key_prefix, version))
        except LimiterUnavailable:
            return []
        if version != self._gw.config_version:
            return []  # the rules changed meanwhile: these stops belong to the old version
        models = self._gw.config.models  # labels and the table: configured models only
        new = self._gw.input_audits.stopped_elsewhere(n for n in names if n in models)
        for model in new:
            self._gw.metrics.input_stops_adopted.labels(model).inc()
            log.warning(
                "input_shortcut_stopped_elsewhere",
                model=model,
                config_version=version,
                note="another replica's count contradicted this model's upstream input figure",
            )
        return new

    def keep(self) -> None:
        """Start the refresh of the shared stops (once per process, with the first request
        admitted on a bound or the first stop found here): at once, then every
        :data:`INPUT_STOPS_REFRESH_S` in which a request was admitted on a bound or a stop
        waits to be written.  An idle replica makes no call; a model's first requests after a
        start are counted until one agrees (its probation), so the first read is never late."""
        if self._store() is None:
            return
        if self._loop is None or self._loop.done():
            loop = asyncio.get_running_loop()
            self._loop = loop.create_task(self._refresh_loop(), context=contextvars.Context())

    async def _refresh_loop(self) -> None:
        while True:
            if self._seen or self._unsent:
                self._seen = False
                try:
                    await self.refresh()
                except Exception:  # never let the loop die: the next period tries again
                    log.exception("input_stops_refresh_failed")
            await asyncio.sleep(INPUT_STOPS_REFRESH_S)

    async def close(self) -> None:
        """Stop the refresh; write what is still unsent, once."""
        task = self._loop
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._unsent:
            await self._write()


class InputNotes:
    """Exact input counts of requests admitted on a bound, on their way to their open ledgers
    (so that a reclaim after a SIGKILL refunds the rest of the bound), a few per Redis call."""

    __slots__ = ("_gw", "_queue", "_task")

    def __init__(self, gw: Host) -> None:
        self._gw = gw
        self._queue: list[InputNote] = []
        self._task: asyncio.Task[None] | None = None

    def note(self, note: InputNote) -> None:
        """Write a request's exact input into its open ledger, in the background (a few
        milliseconds, many notes per call).  A note that cannot be written (no room in the
        queue, Redis failing) leaves the bound in the ledger: a SIGKILL then bills it, the
        over-count it was before; the request's own settlement is not affected."""
        if getattr(self._gw.limiter, "note_inputs", None) is None:
            return
        if len(self._queue) >= MAX_INPUT_NOTES:
            self._gw.metrics.input_notes.labels("dropped").inc()
            return
        self._queue.append(note)
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._write(), context=contextvars.Context())

    async def _write(self) -> None:
        while self._queue:
            await asyncio.sleep(INPUT_NOTE_TICK_S)  # others join the call
            notes, self._queue = self._queue, []
            noter: InputNoter = cast("InputNoter", self._gw.limiter)
            results = await noter.note_inputs(notes)
            for r in results:
                self._gw.metrics.input_notes.labels(
                    "written" if r else "failed" if r is None else "closed"
                ).inc()
