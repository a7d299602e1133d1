"""Seeing a new master and replaying the journal to it before anything else.

A master is known by its ``run_id`` (``INFO server``): it changes when a replica is promoted
(Sentinel's switch-master, a Cluster slot's new primary) and when a server restarts, the two
events that can lose acknowledged writes.  The limiter marks the backend *suspect* whenever a
call fails (a connection refused or reset, a timeout, READONLY, a redirection to a dead node).
While suspect, the next call first runs a *recovery* (one at a time, shared by every caller
and shielded from their timeouts): ask the master of each slot the journal holds for its run
id; where it is not the one that acknowledged an entry, replay those entries to it in order
(:mod:`extproc.limiter.journal`).  Only then does the call go on.  That alone does not keep
a new master from getting a ledger's later calls before its lost history (connections opened
after the promotion reach the new master before the processor sees the switch, e.g. while the
old master is frozen), so each replayed call applies once in any order: an admission, a stream
charge and a settlement are each idempotent by a mark of their own in the ledger (admit.lua,
charge.lua, settle_lib.lua), never by the ledger's existence.  Behind Sentinel the run id is
asked of the master the sentinels name (see :meth:`Failover._run_id`).  A watch
task does the same every ``watch_s`` while suspect (so an open breaker closes as soon as the
new master answers, and an idle replica still replays) and every ``idle_check_s`` while the
journal holds entries (a failover nobody's call noticed).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis.exceptions
import structlog
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool

from extproc.limiter.journal import Entry, Journal
from extproc.limiter.starvation import LoopLag, fair_wait

if TYPE_CHECKING:
    from extproc.metrics import Metrics

log = structlog.get_logger("extproc.limiter.failover")

#: What a master that cannot be reached raises (its slot's calls wait for the next recovery).
_UNREACHABLE = (redis.exceptions.RedisError, OSError, asyncio.TimeoutError)

#: Entries sent per pipeline when replaying to a single master.
REPLAY_CHUNK = 200


class Failover:
    """Tracks which master acknowledged what, and replays the journal to a new one."""

    def __init__(
        self,
        client: Any,
        scripts: dict[str, Any],
        journal: Journal,
        *,
        metrics: Metrics | None = None,
        watch_s: float = 0.2,
        idle_check_s: float = 1.0,
        check_timeout_s: float = 1.0,
        on_recovered: Callable[[bool], None] | None = None,
        lag: LoopLag | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        #: the journal's times and the recoveries' durations (seconds)
        self._monotonic = monotonic
        self._cluster = isinstance(client, RedisCluster)
        self._scripts = scripts
        self.journal = journal
        self.metrics = metrics
        self.watch_s = watch_s
        self.idle_check_s = idle_check_s
        #: how long asking a master its run id may take (a frozen master never answers)
        self.check_timeout_s = check_timeout_s
        #: the limiter's measure of the event loop's lateness: the check's timeout is of the
        #: processor's running time, as a call's is (a starved processor is slower, not
        #: failed: extproc.limiter.starvation)
        self._lag = lag if lag is not None else LoopLag()
        self._on_recovered = on_recovered
        self.suspect = True  # nothing is known about the master yet
        # Cluster: slots whose master could not be asked (its node down): their calls fail
        # until a recovery reaches the new master; slots checked since the last failure
        self.pending: set[int] = set()
        self._checked: set[int] = set()
        self._run_ids: dict[str, str] = {}  # node name ("" single server) -> run id
        self._master_addr: Any = None  # Sentinel: the master's address last named
        self._recovery: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        self.failovers = 0
        self.replays = 0
        self.replayed = 0

    # -- bookkeeping -------------------------------------------------------------------------

    def _node_name(self, slot: int) -> str:
        if not self._cluster:
            return ""
        node = self._client.nodes_manager.get_node_from_slot(slot)
        return str(node.name)

    def owner(self, slot: int) -> str:
        """The run id last seen for the master of ``slot`` ("" unknown)."""
        try:
            return self._run_ids.get(self._node_name(slot), "")
        except Exception:  # a Cluster slot map being rebuilt
            return ""

    def record(
        self,
        script: str,
        keys: list[str],
        args: list[Any],
        ttl_ms: int,
        *,
        slot: int,
        owner: str,
    ) -> None:
        """Journal an acknowledged call (its replay form); ``owner``: :meth:`owner` of its
        slot when the call was sent (a call sent before a failover was seen is replayed)."""
        now = self._monotonic()
        self.journal.add(Entry(now, now + ttl_ms / 1000.0, script, keys, args, slot, owner))
        self._export()
        self._start_watch()

    def failed(self) -> None:
        """A call failed: the master may have changed; check before the next call."""
        self.suspect = True
        self._checked.clear()
        self._start_watch()

    def answered(self) -> None:
        """A call succeeded while not suspect: old entries can go."""
        if not self.suspect:
            self.journal.confirm(self._monotonic())

    # -- recovery ----------------------------------------------------------------------------

    async def ensure(self, slot: int = 0) -> None:
        """While suspect, wait for a recovery (starting one if none runs) before a call on
        ``slot``; it raises what the recovery raised (the call then fails as Redis
        unavailable).  On a Cluster only the slots the journal holds wait, and a slot whose
        master could not be reached fails at once."""
        if not self.suspect:
            return
        if self._cluster and (slot in self._checked or not self.journal.holds(slot)):
            return
        task = self._recovery
        if task is None or task.done():
            task = self._recovery = asyncio.get_running_loop().create_task(self._recover())
        await asyncio.shield(task)
        if slot in self.pending:
            raise redis.exceptions.ConnectionError(
                f"the master of slot {slot} has not answered since a failure; its journal is "
                "not replayed yet"
            )

    async def _run_id(self, node: Any) -> str:
        """The run id of the master (of ``node`` on a Cluster), within
        :attr:`check_timeout_s`.  Behind Sentinel, the master the sentinels name now is asked:
        the pool first learns its address (when it changed, every connection is closed), so the
        answer never comes from a stale master that runs again on an old connection (a
        frozen master that wakes up still answers with its run id until it is demoted), and
        no later call is acknowledged there."""

        async def ask() -> str:
            if node is not None:
                info = await self._client.info("server", target_nodes=node)
                return str(info["run_id"])
            pool = getattr(self._client, "connection_pool", None)
            if isinstance(pool, SentinelConnectionPool) and pool.is_master:
                addr = await pool.get_master_address()  # type: ignore[no-untyped-call]
                if self._master_addr is not None and addr != self._master_addr:
                    # a connection in use now may still reach the old master, and redis-py
                    # takes it back into the pool: close every one (a call in flight fails
                    # and is sent again, idempotent), so none acknowledges there any more
                    await pool.disconnect(inuse_connections=True)
                self._master_addr = addr
            info = await self._client.info("server")
            return str(info["run_id"])

        budget = self.check_timeout_s
        return await fair_wait(ask(), budget, self._lag, max(20 * budget, 10.0))

    async def _recover(self) -> None:
        started = self._monotonic()
        now = self._monotonic()
        entries = self.journal.replayable(now)
        by_slot: dict[int, list[Entry]] = {}
        for e in entries:
            by_slot.setdefault(e.slot, []).append(e)
        changed = False
        before = self.replayed
        if not self._cluster:
            rid = await self._run_id(None)
            known = self._run_ids.get("")
            if known is not None and known != rid:
                changed = True
                log.warning("redis_new_master", previous=known, now=rid, journal=len(entries))
            await self._replay_single([e for e in entries if e.owner != rid], rid)
            self._run_ids[""] = rid  # only once caught up: a failed replay is tried again
        else:
            if not self._run_ids:  # the first time: learn every primary's run id
                await self._client.initialize()
                for node in self._client.get_primaries():
                    with contextlib.suppress(*_UNREACHABLE):
                        self._run_ids[node.name] = await self._run_id(node)
            results = await asyncio.gather(
                *(self._recover_slot(slot, group) for slot, group in by_slot.items()),
                return_exceptions=True,
            )
            for slot, res in zip(by_slot, results, strict=True):
                if isinstance(res, BaseException):
                    if not isinstance(res, _UNREACHABLE):
                        raise res
                    self.pending.add(slot)
                else:
                    self.pending.discard(slot)
                    self._checked.add(slot)
                    changed = changed or res
            self.pending &= set(by_slot)
        if changed:
            self.failovers += 1
            if self.metrics is not None:
                self.metrics.redis_failovers.inc()
            log.warning(
                "redis_failover_recovered",
                replayed=self.replayed - before,
                seconds=round(self._monotonic() - started, 3),
            )
        self.suspect = bool(self.pending)
        if self._on_recovered is not None:
            self._on_recovered(changed)
        self._export()

    async def _replay_single(self, entries: list[Entry], rid: str) -> None:
        if not entries:
            return
        self.replays += 1
        if self.metrics is not None:
            self.metrics.journal_replays.inc()
        for start in range(0, len(entries), REPLAY_CHUNK):
            chunk = entries[start : start + REPLAY_CHUNK]
            async with self._client.pipeline(transaction=False) as pipe:
                for e in chunk:
                    await self._scripts[e.script](keys=e.keys, args=e.args, client=pipe)
                await pipe.execute()
            self._replayed(chunk, rid)

    async def _recover_slot(self, slot: int, entries: list[Entry]) -> bool:
        """Cluster: ask the master of ``slot`` its run id and replay the slot's entries it
        did not acknowledge; whether it is a new master."""
        manager = self._client.nodes_manager
        node = manager.get_node_from_slot(slot)
        try:
            rid = await self._run_id(node)
        except _UNREACHABLE:
            # The slot map may name a dead primary whose replica was promoted since: refresh
            # it now (redis-py's own refresh after an error waits its minimum interval and
            # needs a command of that slot, which waits on this recovery) and ask the primary
            # it names, if another.
            await manager.initialize(last_failed_node_name=node.name)
            fresh = manager.get_node_from_slot(slot)
            if fresh.name == node.name:
                raise
            node = fresh
            rid = await self._run_id(node)
        known = self._run_ids.get(node.name)
        stale = [e for e in entries if e.owner != rid]
        new_master = (known is not None and known != rid) or any(e.owner for e in stale)
        if new_master:
            log.warning("redis_new_master", node=node.name, slot=slot, previous=known, now=rid)
        if stale:
            await self._replay_slot(stale, rid)
        self._run_ids[node.name] = rid  # only once caught up
        return new_master

    async def _replay_slot(self, entries: list[Entry], rid: str) -> None:
        self.replays += 1
        if self.metrics is not None:
            self.metrics.journal_replays.inc()
        for e in entries:  # one slot: in order
            await self._scripts[e.script](keys=e.keys, args=e.args)
            self._replayed([e], rid)

    def _replayed(self, entries: list[Entry], rid: str) -> None:
        for e in entries:
            e.owner = rid  # now held by this master: not replayed again
            if self.metrics is not None:
                self.metrics.journal_replayed.labels(e.script).inc()
        self.replayed += len(entries)

    # -- the watch ---------------------------------------------------------------------------

    def _start_watch(self) -> None:
        if self._watch is not None and not self._watch.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._watch = loop.create_task(self._watching())

    async def _watching(self) -> None:
        idle = 0.0
        while self.suspect or len(self.journal):
            await asyncio.sleep(self.watch_s)
            idle += self.watch_s
            if not self.suspect:
                if idle < self.idle_check_s:
                    continue
                self.suspect = True  # a periodic check: did the master change unnoticed?
            idle = 0.0
            with contextlib.suppress(Exception):
                await self.ensure()
            if not self.suspect:
                self.journal.confirm(self._monotonic())
            self._export()

    def _export(self) -> None:
        m = self.metrics
        if m is not None:
            m.journal_entries.set(len(self.journal))
            m.journal_dropped.set(self.journal.dropped)

    async def close(self) -> None:
        for task in (self._watch, self._recovery):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
