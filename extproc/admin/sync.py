"""Every replica follows the admin store: it subscribes to the change channel, polls the
version every :data:`POLL_S` (a replica that missed a message catches up), and swaps in the
rules file merged with the newest snapshot.  Lookups stay in process memory: nothing here runs
on the request path.

Propagation bound: a change is applied as soon as its message arrives, and at the latest one
poll interval (0.5 s) plus the compile (milliseconds) after it was stored; a rotated key's
grace ends within one poll interval of its expiry.  When Redis does not answer, the replica
keeps the last snapshot it applied (the rules file's tenants and keys work throughout) and
catches up when Redis answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
from redis.exceptions import RedisError

from extproc.admin.rules import Effective, FileRules, effective, read_file_rules
from extproc.admin.state import StoreState
from extproc.admin.store import AdminStore, StoreUnavailable
from extproc.config.load import ConfigError

if TYPE_CHECKING:
    from extproc.metrics import Metrics

log = structlog.get_logger("extproc.admin")

#: How often a replica compares its version with the store's.
POLL_S = 0.5


class StoreSync:
    """Keeps one replica's rules in step with the admin store."""

    def __init__(
        self,
        store: AdminStore,
        rules: FileRules,
        apply: Callable[[Effective], None],
        *,
        version_of: Callable[[str], str] | None = None,
        poll_s: float = POLL_S,
        subscribe: bool = True,
        now: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
    ) -> None:
        self.store = store
        self.rules = rules
        self.apply = apply
        self.version_of = version_of
        self.poll_s = poll_s
        self.subscribe = subscribe
        self.now = now
        self.metrics = metrics
        #: the snapshot the running rules were built from
        self.state = StoreState()
        self.current = Effective(rules.config, rules.version, 0)
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._failed_version = -1
        self._installed_at = 0.0
        self._down = False
        self._stopping = False

    async def start(self, timeout_s: float = 1.0) -> None:
        """Load the snapshot (Redis not answering within ``timeout_s``: start with the file
        alone and catch up later), then follow the store in the background."""
        try:
            await asyncio.wait_for(self.refresh(force=True), timeout_s)
        except (StoreUnavailable, TimeoutError) as exc:
            log.warning("admin_store_unavailable_at_start", error=str(exc) or "timeout")
            self._set_down(True)
        else:
            self._set_down(False)
        self._tasks.append(asyncio.create_task(self._poll(), name="admin-store-poll"))
        if self.subscribe:
            self._tasks.append(asyncio.create_task(self._listen(), name="admin-store-listen"))

    async def stop(self) -> None:
        """Stop following the store."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # bounded: a connection stuck in a read must not hold up the shutdown
            await asyncio.wait(self._tasks, timeout=2.0)
        self._tasks.clear()

    async def refresh(self, *, force: bool = False) -> bool:
        """Load and apply the snapshot if the store moved on (or ``force``); whether the
        running rules changed."""
        async with self._lock:
            version = await self.store.version()
            if not force and version == self.state.version:
                return False
            state = await self.store.load()
            if not force and state.version == self.state.version:
                return False
            return await self._install(state)

    async def _install(self, state: StoreState) -> bool:
        rules, now = self.rules, self.now()
        try:
            eff = await asyncio.to_thread(effective, rules, state, now)
            if self.rules is not rules:  # a SIGHUP swapped the file meanwhile
                eff = effective(self.rules, state, now)
        except ConfigError as exc:
            self.state = state
            if self._failed_version != state.version:
                self._failed_version = state.version
                log.error(
                    "admin_store_not_applied",
                    store_version=state.version,
                    error=str(exc),
                    note="the replica keeps the rules it runs on",
                )
            return False
        self.state, self._installed_at = state, now
        if self.metrics is not None:
            self.metrics.admin_store_version.set(state.version)
        changed = eff.version != self.current.version
        self.current = eff
        self.apply(eff)
        for reason in eff.skipped:
            log.warning("admin_store_entry_skipped", store_version=state.version, reason=reason)
        log.info("admin_store_applied", store_version=state.version, config_version=eff.version)
        return changed

    def reload_file(self, path: str) -> Effective:
        """SIGHUP: read the rules file again and merge the last snapshot into it (not
        applied here: the caller swaps it in).  :class:`ConfigError` leaves everything as is."""
        if self.version_of is None:
            raise RuntimeError("StoreSync.reload_file needs version_of")
        rules, now = read_file_rules(path, self.version_of), self.now()
        eff = effective(rules, self.state, now)
        self.rules, self.current, self._installed_at = rules, eff, now
        return eff

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self._check_expiry()
                await self.refresh()
                if self._down:
                    self._set_down(False)
                    log.info("admin_store_answering", store_version=self.state.version)
            except StoreUnavailable as exc:
                if not self._down:
                    self._set_down(True)
                    log.warning(
                        "admin_store_unavailable",
                        error=str(exc),
                        note="keeping the last snapshot",
                        store_version=self.state.version,
                    )
            except Exception:
                log.exception("admin_store_poll_failed")

    def _set_down(self, down: bool) -> None:
        self._down = down
        if self.metrics is not None:
            self.metrics.admin_store_up.set(0 if down else 1)

    async def _check_expiry(self) -> None:
        """A rotated key's grace ended: rebuild from the snapshot already held."""
        ends = self.state.next_expiry(self._installed_at)
        if ends is not None and self.now() >= ends:
            async with self._lock:
                await self._install(self.state)

    async def _listen(self) -> None:
        # On Redis Cluster the subscription is on the node the channel hashes to; PUBLISH
        # reaches every node of the cluster, so any node would do.  The loop also ends on
        # ``_stopping``: redis-py's pubsub read can swallow a cancellation (its own read
        # timeout firing at the same moment), and a task that lives on holds the process.
        while not self._stopping:
            pubsub: Any = None
            try:
                pubsub = self.store.client.pubsub()
                await pubsub.subscribe(self.store.channel)
                await self.refresh()  # whatever changed while not subscribed
                while not self._stopping:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is not None:
                        await self.refresh()
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, StoreUnavailable) as exc:
                log.debug("admin_store_subscription_lost", error=str(exc))
                await asyncio.sleep(1.0)
            except Exception:
                log.exception("admin_store_listen_failed")
                await asyncio.sleep(1.0)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(pubsub.aclose(), 1.0)
