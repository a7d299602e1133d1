"""The admin store in Redis: one snapshot document, replaced atomically by every change.

Keys (one Redis Cluster slot, hash tag ``{<prefix>:admin}``):

* ``{aiq:admin}:version``: the change counter (absent: 0);
* ``{aiq:admin}:snapshot``: the current :class:`StoreState` as JSON (it carries its version);
* ``{aiq:admin}:snapshot:<version>``: each version's snapshot, kept for
  :data:`HISTORY_TTL_S` (a copy to restore by hand);
* ``{aiq:admin}:audit``: the audit log, a stream of one entry per change (who, what, which
  version), capped at about :data:`AUDIT_MAXLEN` entries.

A change is compare-and-set: :meth:`AdminStore.update` reads the snapshot, applies a function
to it and writes the result with a Lua script that checks the version is still the one read,
bumps it, stores the snapshot and its history copy, appends the audit entry, and publishes the
new version on the channel ``<prefix>:admin:changed``, all in one step (a change is never
stored without its audit entry, nor audited without being stored).  A concurrent change makes the script
refuse, and the update is retried on the newer snapshot.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from redis.exceptions import RedisError

from extproc.admin.state import StoreState
from extproc.limiter.redis_url import async_client

T = TypeVar("T")

#: How long each version's snapshot copy is kept.
HISTORY_TTL_S = 7 * 24 * 3600
#: About how many audit entries are kept (``XADD MAXLEN ~``).
AUDIT_MAXLEN = 100_000

# KEYS: version, snapshot, this version's history copy, the audit stream.
# ARGV: the version the change was computed from, the snapshot, the channel, the history TTL
# (s), the audit cap, then the audit entry's field/value pairs.
_WRITE = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current ~= tonumber(ARGV[1]) then
  return -1
end
local version = redis.call('INCR', KEYS[1])
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SET', KEYS[3], ARGV[2], 'EX', tonumber(ARGV[4]))
local entry = {'XADD', KEYS[4], 'MAXLEN', '~', ARGV[5], '*', 'version', version}
for i = 6, #ARGV do
  entry[#entry + 1] = ARGV[i]
end
redis.call(unpack(entry))
redis.call('PUBLISH', ARGV[3], version)
return version
"""


@dataclass(frozen=True)
class AuditEntry:
    """One change: its stream id, the version it made, when (unix ms), and what the admin
    API recorded (``action``, ``principal``, ``tenant``, ``key_id``... strings)."""

    id: str
    version: int
    at_ms: int
    fields: dict[str, str]


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class StoreUnavailable(RuntimeError):
    """Redis did not answer (or answered with an error)."""


class Conflict(RuntimeError):
    """The store kept changing under an update (it was retried and gave up)."""


def connect(url: str, *, timeout_s: float = 1.0) -> Any:
    """A client for any Redis URL the limiter takes (:mod:`extproc.limiter.redis_url`)."""
    return async_client(url, timeout_s=timeout_s)


class AdminStore:
    """Reads and changes the snapshot; one per process."""

    def __init__(self, client: Any, *, prefix: str = "aiq") -> None:
        self.client = client
        self.prefix = prefix
        tag = f"{{{prefix}:admin}}"
        self.version_key = f"{tag}:version"
        self.snapshot_key = f"{tag}:snapshot"
        self.audit_key = f"{tag}:audit"
        self.channel = f"{prefix}:admin:changed"
        self._write = client.register_script(_WRITE)

    @classmethod
    def from_url(cls, url: str, *, prefix: str = "aiq", timeout_s: float = 1.0) -> AdminStore:
        """Connect lazily to ``url``."""
        return cls(connect(url, timeout_s=timeout_s), prefix=prefix)

    def history_key(self, version: int) -> str:
        """Where the snapshot of ``version`` is kept for a while."""
        return f"{self.snapshot_key}:{version}"

    async def version(self) -> int:
        """The current version (0: nothing was ever stored)."""
        try:
            raw = await self.client.get(self.version_key)
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"admin store: {exc}") from exc
        return int(raw or 0)

    async def load(self) -> StoreState:
        """The current snapshot (empty at version 0)."""
        try:
            raw = await self.client.get(self.snapshot_key)
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"admin store: {exc}") from exc
        if raw is None:
            return StoreState()
        return StoreState.from_json(raw)

    async def update(
        self,
        change: Callable[[StoreState], tuple[StoreState, T]],
        *,
        audit: Callable[[T], Mapping[str, str]] | None = None,
        attempts: int = 20,
    ) -> tuple[StoreState, T]:
        """Apply ``change`` (which returns the new state and a result, or raises) to the
        current snapshot and store it as the next version, with the audit entry ``audit``
        makes of the result; the stored state and the result."""
        for _ in range(attempts):
            current = await self.load()
            new, result = change(current)
            stored = replace(new, version=current.version + 1)
            entry = {"at_ms": str(int(time.time() * 1000)), **(audit(result) if audit else {})}
            args: list[Any] = [current.version, stored.to_json(), self.channel, HISTORY_TTL_S]
            args.append(AUDIT_MAXLEN)
            for name, value in entry.items():
                args += [name, value]
            try:
                version = await self._write(
                    keys=[
                        self.version_key,
                        self.snapshot_key,
                        self.history_key(stored.version),
                        self.audit_key,
                    ],
                    args=args,
                )
            except (RedisError, OSError) as exc:
                raise StoreUnavailable(f"admin store: {exc}") from exc
            if int(version) == stored.version:
                return stored, result
            await asyncio.sleep(0.005)  # another change won: apply ours to it
        raise Conflict("the admin store kept changing; try again")

    async def audit_log(self, *, since_version: int = 0, count: int = 100) -> list[AuditEntry]:
        """The newest ``count`` audit entries of versions above ``since_version``, oldest
        first."""
        try:
            rows = await self.client.xrevrange(self.audit_key, count=max(1, count))
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"admin store: {exc}") from exc
        out: list[AuditEntry] = []
        for entry_id, raw in rows:
            fields = {_s(k): _s(v) for k, v in raw.items()}
            version = int(fields.pop("version", "0") or 0)
            if version <= since_version:
                break
            at_ms = int(fields.pop("at_ms", "0") or 0)
            out.append(AuditEntry(_s(entry_id), version, at_ms, fields))
        out.reverse()
        return out

    async def close(self) -> None:
        """Close the connections."""
        close = getattr(self.client, "aclose", None) or self.client.close
        await close()
