"""One parser for ``AIQ_REDIS_URL`` and one factory per client kind, used by everything that
talks to Redis (the limiter, the usage records, the admin store, ``ai-quota usage export``).

Three topologies:

- ``redis://[user:password@]host:port[/db]`` (``rediss://`` for TLS): one server;
- ``redis+cluster://[user:password@]host:port`` (``rediss+cluster://``): Redis Cluster, the
  address of any node (the others are discovered);
- ``redis+sentinel://[user:password@]host:port[,host:port...]/<master-name>[/db]``
  (``rediss+sentinel://``): a Sentinel group; the processor asks the sentinels for the
  master of ``master-name`` and follows it when they fail over.  The credentials are the
  master's (and its replicas'); a query ``?sentinel_password=...`` (and
  ``sentinel_username``) authenticates to the sentinels themselves.

Every client is made with redis-py's own retry switched off (redis-py 8 re-sends a command up
to 10 times after a timeout or a connection error, so a script that ran but whose answer was
lost would run again): the limiter decides what may be sent twice (only calls idempotent by a
key they carry, see :mod:`extproc.limiter.redis`).  TLS options ride in the query as redis-py
reads them (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``,
``ssl_check_hostname``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.cluster
import redis.sentinel
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.backoff import NoBackoff

Kind = Literal["single", "cluster", "sentinel"]

_SCHEMES: dict[str, tuple[Kind, bool]] = {
    "redis": ("single", False),
    "rediss": ("single", True),
    "unix": ("single", False),
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
}

#: TLS options accepted in a Sentinel URL's query (a single server's and a Cluster's query is
#: read by redis-py itself).
_TLS_OPTIONS = frozenset(
    {"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname"}
)
_SENTINEL_AUTH = frozenset({"sentinel_password", "sentinel_username"})


class RedisUrlError(ValueError):
    """``AIQ_REDIS_URL`` (or ``--redis-url``) cannot be used; the message says why."""


@dataclass(frozen=True)
class RedisTarget:
    """What a Redis URL names."""

    kind: Kind
    url: str  # as given
    tls: bool = False
    #: single / cluster: the URL redis-py's ``from_url`` takes (``redis://`` or ``rediss://``)
    plain_url: str = ""
    #: sentinel: the sentinels' addresses, the master's name, the database, credentials
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    sentinel_auth: dict[str, str] = field(default_factory=dict)


def _port(text: str, url: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise RedisUrlError(f"{redact(url)}: port {text!r} is not a number") from None
    if not 0 < port < 65536:
        raise RedisUrlError(f"{redact(url)}: port {port} is out of range")
    return port


def _hostport(item: str, url: str) -> tuple[str, int]:
    item = item.strip()
    if not item:
        raise RedisUrlError(f"{redact(url)}: an empty sentinel address")
    if item.startswith("["):  # [ipv6]:port
        host, sep, rest = item[1:].partition("]")
        if not sep:
            raise RedisUrlError(f"{redact(url)}: unclosed '[' in {item!r}")
        port = rest.removeprefix(":") if rest.startswith(":") else ""
    else:
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
    if not host:
        raise RedisUrlError(f"{redact(url)}: sentinel address {item!r} has no host")
    return host, _port(port, url) if port else 26379


def parse_redis_url(url: str) -> RedisTarget:
    """Parse a Redis URL of any supported topology; :class:`RedisUrlError` says what is wrong."""
    scheme, sep, _ = url.partition("://")
    if not sep:
        raise RedisUrlError(
            f"{redact(url)}: not a Redis URL (expected redis://, rediss://, redis+cluster://, "
            "redis+sentinel:// or rediss+sentinel://)"
        )
    scheme = scheme.lower()
    if scheme not in _SCHEMES:
        raise RedisUrlError(
            f"{redact(url)}: unknown scheme {scheme!r} (expected one of "
            + ", ".join(s + "://" for s in _SCHEMES)
            + ")"
        )
    kind, tls = _SCHEMES[scheme]
    rest = url[len(scheme) + 3 :]
    if kind != "sentinel":
        plain = ("rediss" if tls else "redis") + "://" + rest if kind == "cluster" else url
        try:
            parts = urlsplit(plain)
            if scheme != "unix" and not parts.hostname:
                raise RedisUrlError(f"{redact(url)}: no host")
        except ValueError as exc:
            raise RedisUrlError(f"{redact(url)}: {exc}") from None
        return RedisTarget(kind, url, tls, plain_url=plain)
    # redis+sentinel://[user:password@]h1:p1,h2:p2/<master>[/db][?query]
    body, _, query = rest.partition("?")
    auth, at, hosts_path = body.rpartition("@")
    if not at:
        auth, hosts_path = "", body
    hosts, slash, path = hosts_path.partition("/")
    if not hosts:
        raise RedisUrlError(f"{redact(url)}: no sentinel address (host:port[,host:port...])")
    sentinels = tuple(_hostport(h, url) for h in hosts.split(","))
    segments = path.split("/") if slash else []
    if segments and segments[-1] == "":
        segments.pop()
    if not segments or not segments[0]:
        raise RedisUrlError(
            f"{redact(url)}: no master name (redis+sentinel://host:port[,host:port...]/<master-name>[/db])"
        )
    if len(segments) > 2:
        raise RedisUrlError(f"{redact(url)}: too many path segments (expected /<master-name>[/db])")
    master = unquote(segments[0])
    db = 0
    if len(segments) == 2:
        if not segments[1].isdigit():
            raise RedisUrlError(f"{redact(url)}: database {segments[1]!r} is not a number")
        db = int(segments[1])
    username: str | None = None
    password: str | None = None
    if auth:
        user, colon, pw = auth.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
        if not colon:  # redis://secret@host is a password, as redis-py reads it
            username, password = None, unquote(user)
    options: dict[str, Any] = {}
    sentinel_auth: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key in _TLS_OPTIONS:
            if not tls:
                raise RedisUrlError(f"{redact(url)}: {key} needs rediss+sentinel://")
            if key == "ssl_check_hostname":
                options[key] = value.lower() in ("1", "true", "yes", "on")
            else:
                options[key] = value
        elif key in _SENTINEL_AUTH:
            sentinel_auth[key.removeprefix("sentinel_")] = value
        else:
            raise RedisUrlError(
                f"{redact(url)}: unknown option {key!r} (known: "
                + ", ".join(sorted(_TLS_OPTIONS | _SENTINEL_AUTH))
                + ")"
            )
    return RedisTarget(
        "sentinel",
        url,
        tls,
        sentinels=sentinels,
        master=master,
        db=db,
        username=username,
        password=password,
        options=options,
        sentinel_auth=sentinel_auth,
    )


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs and error messages)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    body, q, query = rest.partition("?")
    auth, at, hosts = body.rpartition("@")
    if at:
        user, colon, _ = auth.partition(":")
        body = (f"{user}:***" if colon else "***") + "@" + hosts
    if query:
        query = "&".join(
            (p.split("=", 1)[0] + "=***") if p.split("=", 1)[0].endswith("password") else p
            for p in query.split("&")
        )
    return f"{scheme}{sep}{body}{q}{query}"


def no_retry() -> Any:
    """A redis-py retry policy that never re-sends (see the module's docstring)."""
    from redis.asyncio.retry import Retry

    return Retry(NoBackoff(), 0)


def _sync_no_retry() -> Any:
    from redis.retry import Retry

    return Retry(NoBackoff(), 0)


class BlockingSentinelConnectionPool(
    aiosentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool
):
    """A Sentinel-managed pool that, like the single server's, makes a caller wait (up to
    ``timeout``) for a free connection instead of failing when all are in use."""


class SentinelMaster(aioredis.Redis):
    """The Sentinel group's master as a client: closing it closes the connections to the
    sentinels too (redis-py leaves them open)."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        manager = getattr(self.connection_pool, "sentinel_manager", None)
        await super().aclose(close_connection_pool)
        if manager is not None:
            for client in manager.sentinels:
                await client.aclose()


class SyncSentinelMaster(redis.Redis):
    """:class:`SentinelMaster` for the blocking client."""

    def close(self) -> None:
        manager = getattr(self.connection_pool, "sentinel_manager", None)
        super().close()
        if manager is not None:
            for client in manager.sentinels:
                client.close()


class PromptSentinel(aiosentinel.Sentinel):
    """redis-py's Sentinel client that also finds a master promoted by a failover still under
    way.

    redis-py takes the address in a sentinel's ``SENTINEL MASTERS`` record, and only while
    that record does not flag the master down; during a failover the record keeps the dead
    master's address, flagged down, until the failover's end (``+switch-master``), after the
    sentinels have reconfigured every other replica (measured under load: 0.94 s after the
    promotion, every call of the processor waiting meanwhile).  From the promotion on, the
    sentinel leading the failover already names the promoted replica in ``SENTINEL
    GET-MASTER-ADDR-BY-NAME``.  When redis-py finds no master, this asks each sentinel for
    that name and takes it only if it differs from the record's address (a replica promoted
    by the failover in progress, never the record's old master, which could run again
    unreconfigured) and the server there answers ``ROLE`` as a master itself."""

    def __init__(
        self, sentinels: list[tuple[str, int]], *, role_kwargs: dict[str, Any], **kw: Any
    ) -> None:
        super().__init__(sentinels, **kw)
        self._role_kwargs = role_kwargs

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        try:
            found: tuple[str, int] = await super().discover_master(service_name)
            return found
        except aiosentinel.MasterNotFoundError:
            promoted = await self.promoted_master(service_name)
            if promoted is None:
                raise
            return promoted

    async def promoted_master(self, service_name: str) -> tuple[str, int] | None:
        """The replica a sentinel names as ``service_name``'s master mid-failover, once it
        answers as a master; None when no sentinel names one."""
        for sentinel in self.sentinels:
            try:
                masters = await sentinel.sentinel_masters()
                named: Any = await sentinel.sentinel_get_master_addr_by_name(service_name)
            except (redis.exceptions.RedisError, OSError):
                continue
            state = masters.get(service_name) if isinstance(masters, dict) else None
            if not state or not named:
                continue
            addr = (str(named[0]), int(named[1]))
            if addr == (str(state["ip"]), int(state["port"])):
                continue  # the record's own address: flagged down, or no failover under way
            if await self._answers_as_master(addr):
                return addr
        return None

    async def _answers_as_master(self, addr: tuple[str, int]) -> bool:
        client = aioredis.Redis(host=addr[0], port=addr[1], retry=no_retry(), **self._role_kwargs)
        try:
            role = await client.execute_command("ROLE")  # type: ignore[no-untyped-call]
        except (redis.exceptions.RedisError, OSError):
            return False
        finally:
            await client.aclose()
        first = role[0] if isinstance(role, list | tuple) and role else b""
        return first in (b"master", "master")


#: How soon after the previous one redis-py may refresh a Cluster's slot map after an error
#: (its default: 1 s).  A primary's failover is seen by that refresh: with 1 s, calls of the
#: dead primary's slots went on failing up to a second after the replica's promotion (the
#: Cluster drill through Envoy: first success 1.17 s after the promotion, the window's p99
#: 0.9-1.4 s above it).  A refresh is one CLUSTER SLOTS call, only while errors ask for one.
CLUSTER_REFRESH_MIN_INTERVAL_S = 0.2
_TAKES_REFRESH_INTERVAL = (
    "topology_refresh_min_interval" in inspect.signature(AsyncRedisCluster.__init__).parameters
)


def _sentinel_kwargs(target: RedisTarget, timeout_s: float) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
    }
    if target.tls:
        kw["ssl"] = True
        kw.update(target.options)
    if "password" in target.sentinel_auth:
        kw["password"] = target.sentinel_auth["password"]
    if "username" in target.sentinel_auth:
        kw["username"] = target.sentinel_auth["username"]
    return kw


def async_client(
    url: str | RedisTarget,
    *,
    timeout_s: float,
    connect_timeout_s: float | None = None,
    max_connections: int | None = None,
    pool_timeout_s: float | None = None,
) -> Any:
    """An asyncio client (lazy: nothing is connected yet) for any supported URL, with
    redis-py's retry off.  ``max_connections`` bounds a single server's or the Sentinel
    master's pool (a caller beyond it waits up to ``pool_timeout_s`` for a free connection),
    or each Cluster node's."""
    target = url if isinstance(url, RedisTarget) else parse_redis_url(url)
    connect = timeout_s if connect_timeout_s is None else connect_timeout_s
    common: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": connect,
    }
    if target.kind == "cluster":
        if max_connections is not None:
            common["max_connections"] = max_connections
        if _TAKES_REFRESH_INTERVAL:
            common["topology_refresh_min_interval"] = CLUSTER_REFRESH_MIN_INTERVAL_S
        return AsyncRedisCluster.from_url(target.plain_url, retry=no_retry(), **common)
    pool_kw: dict[str, Any] = {
        **common,
        "retry": no_retry(),
        "max_connections": max_connections or 128,
        "timeout": pool_timeout_s if pool_timeout_s is not None else timeout_s,
    }
    if target.kind == "single":
        pool = aioredis.BlockingConnectionPool.from_url(target.plain_url, **pool_kw)
        return aioredis.Redis.from_pool(pool)  # owns the pool: close() disconnects it
    master_kw: dict[str, Any] = {"db": target.db, **pool_kw}
    if target.username is not None:
        master_kw["username"] = target.username
    if target.password is not None:
        master_kw["password"] = target.password
    if target.tls:
        master_kw["connection_class"] = aiosentinel.SentinelManagedSSLConnection
        master_kw.update(target.options)
    role_kw = {
        k: v
        for k, v in master_kw.items()
        if k not in ("db", "retry", "max_connections", "timeout", "connection_class")
    }
    if target.tls:
        role_kw["ssl"] = True
    sentinel = PromptSentinel(
        list(target.sentinels),
        role_kwargs=role_kw,
        sentinel_kwargs=_sentinel_kwargs(target, connect),
    )
    return sentinel.master_for(
        target.master,
        redis_class=SentinelMaster,
        connection_pool_class=BlockingSentinelConnectionPool,
        **master_kw,
    )


def sync_client(url: str | RedisTarget, *, timeout_s: float) -> Any:
    """A blocking client for any supported URL (``ai-quota usage export``), redis-py's retry
    off."""
    target = url if isinstance(url, RedisTarget) else parse_redis_url(url)
    if target.kind == "cluster":
        return redis.cluster.RedisCluster.from_url(
            target.plain_url, socket_connect_timeout=timeout_s, retry=_sync_no_retry()
        )
    if target.kind == "single":
        return redis.Redis.from_url(
            target.plain_url, socket_connect_timeout=timeout_s, retry=_sync_no_retry()
        )
    kw: dict[str, Any] = {"db": target.db, "socket_connect_timeout": timeout_s}
    if target.username is not None:
        kw["username"] = target.username
    if target.password is not None:
        kw["password"] = target.password
    if target.tls:
        kw["connection_class"] = redis.sentinel.SentinelManagedSSLConnection
        kw.update(target.options)
    sentinel = redis.sentinel.Sentinel(
        list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target, timeout_s)
    )
    return sentinel.master_for(target.master, redis_class=SyncSentinelMaster, **kw)


async def check_master(url: str | RedisTarget, *, timeout_s: float = 1.0) -> None:
    """For a Sentinel URL: raise :class:`RedisUrlError` when every sentinel that answers says
    it knows no master of that name (a configuration mistake, not an outage).  Sentinels that
    do not answer prove nothing: no error then.  Other URLs: nothing to check."""
    target = url if isinstance(url, RedisTarget) else parse_redis_url(url)
    if target.kind != "sentinel":
        return
    kw = _sentinel_kwargs(target, timeout_s)
    answered, known = 0, set[str]()
    for host, port in target.sentinels:
        client = aioredis.Redis(host=host, port=port, retry=no_retry(), **kw)
        try:
            masters = await client.sentinel_masters()
        except (redis.exceptions.RedisError, OSError):
            continue
        finally:
            await client.aclose()
        answered += 1
        names = {str(k) for k in masters} if isinstance(masters, dict) else set()
        known |= names
        if target.master in names:
            return
    if answered:
        listed = ", ".join(sorted(known)) or "none"
        raise RedisUrlError(
            f"{redact(target.url)}: no sentinel knows a master named {target.master!r} "
            f"(the {answered} that answered monitor: {listed})"
        )
