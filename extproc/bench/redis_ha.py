"""Real Redis HA topologies on loopback for the failover drills (``scripts/bench --only failover``
and tests/faults/test_redis_ha_drills.py): a Sentinel group (a master, its replicas, three
sentinels) and a Cluster with replicas.  Every process is started here and stopped by
``stop()``; waits poll the real servers, bounded in time."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import redis

from extproc.stack import free_port, port_in_use


def spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start ``argv`` with its output appended to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)  # noqa: S603 - redis-server


def _binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    return path


def _resp(*words: str) -> bytes:
    """One command in RESP."""
    out = f"*{len(words)}\r\n"
    for w in words:
        out += f"${len(w.encode())}\r\n{w}\r\n"
    return out.encode()


def wait_ping(port: int, within_s: float = 10.0, **kw: Any) -> None:
    """Until the server on ``port`` answers PING (``kw``: TLS options)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            with redis.Redis(port=port, socket_timeout=1, **kw) as c:
                c.ping()
            return
        except redis.exceptions.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class SentinelGroup:
    """``replicas + 1`` redis-servers (the first the master) and ``sentinels`` sentinels
    (quorum 2) monitoring it as ``name``, with ``down-after-milliseconds`` ``down_after_ms``."""

    def __init__(
        self,
        workdir: Path,
        *,
        name: str = "aiq",
        replicas: int = 2,
        sentinels: int = 3,
        down_after_ms: int = 1000,
        extra: list[str] | None = None,
        tls_cert: Path | None = None,
    ) -> None:
        self.workdir = workdir
        self.name = name
        # TLS (tls_cert and its key beside it, .key): every server and sentinel listens with
        # TLS only, replication and the sentinels' links included
        self._kw: dict[str, Any] = {}
        tls_args: list[str] = []
        tls_conf = ""
        if tls_cert is not None:
            key = tls_cert.with_suffix(".key")
            self._kw = {"ssl": True, "ssl_ca_certs": str(tls_cert)}
            tls_args = [
                *("--tls-cert-file", str(tls_cert), "--tls-key-file", str(key)),
                *("--tls-ca-cert-file", str(tls_cert), "--tls-auth-clients", "no"),
                *("--tls-replication", "yes"),
            ]
            tls_conf = (
                f"tls-cert-file {tls_cert}\ntls-key-file {key}\ntls-ca-cert-file {tls_cert}\n"
                "tls-auth-clients no\ntls-replication yes\n"
            )
        port_flag = "--tls-port" if tls_cert is not None else "--port"
        workdir.mkdir(parents=True, exist_ok=True)
        binary = _binary()
        self.ports = [free_port() for _ in range(replicas + 1)]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self._argv: dict[int, list[str]] = {}
        for i, port in enumerate(self.ports):
            d = workdir / f"redis-{port}"
            d.mkdir(exist_ok=True)
            argv = [
                binary,
                port_flag,
                str(port),
                *(("--port", "0") if tls_cert is not None else ()),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(d),
                *tls_args,
                *(extra or []),
            ]
            if i > 0:
                argv += ["--replicaof", "127.0.0.1", str(self.ports[0])]
            self._argv[port] = argv
            self.procs[port] = spawn(argv, d / "redis.log")
        for port in self.ports:
            wait_ping(port, **self._kw)
        # the replicas online before the sentinels start: a sentinel learns a master's replicas
        # from its INFO, asked at once and then every 10 s; one asked before the replicas were
        # online knew none for 10 s, and a master killed meanwhile was never failed over
        # ("-failover-abort-no-good-slave": the drills' "no new master was promoted")
        self.replicas = replicas
        self.wait_replicas(replicas, master=self.ports[0])
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        for port in self.sentinel_ports:
            d = workdir / f"sentinel-{port}"
            d.mkdir(exist_ok=True)
            conf = d / "sentinel.conf"
            listen = f"port 0\ntls-port {port}\n" if tls_cert is not None else f"port {port}\n"
            conf.write_text(
                f"{listen}bind 127.0.0.1\ndir {d}\n{tls_conf}"
                f"sentinel monitor {name} 127.0.0.1 {self.ports[0]} 2\n"
                f"sentinel down-after-milliseconds {name} {down_after_ms}\n"
                f"sentinel failover-timeout {name} 10000\n"
                f"sentinel parallel-syncs {name} 1\n"
            )
            self.procs[port] = spawn([binary, str(conf), "--sentinel"], d / "sentinel.log")
        for port in self.sentinel_ports:
            wait_ping(port, **self._kw)
        self.wait_sentinels_agree(self.ports[0])

    def url(self, scheme: str = "redis+sentinel", name: str | None = None) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"{scheme}://{hosts}/{name or self.name}"

    def master_port(self) -> int:
        """The master's port as the first answering sentinel sees it."""
        for port in self.sentinel_ports:
            try:
                with redis.Redis(port=port, socket_timeout=1, **self._kw) as c:
                    addr = c.sentinel_get_master_addr_by_name(self.name)
                if addr:
                    return int(addr[1])
            except redis.exceptions.RedisError:
                continue
        raise RuntimeError("no sentinel answered")

    def wait_replicas(self, n: int, within_s: float = 15.0, master: int | None = None) -> None:
        """Until ``n`` replicas are online at ``master`` (the sentinels' master by default)."""
        deadline = time.monotonic() + within_s
        master = self.master_port() if master is None else master
        while True:
            with redis.Redis(port=master, socket_timeout=1, **self._kw) as c:
                info = c.info("replication")
            online = sum(
                1
                for k, v in info.items()
                if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"
            )
            if online >= n:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {online} of {n} replicas online")
            time.sleep(0.05)

    def wait_sentinels_agree(self, master: int, within_s: float = 20.0) -> None:
        """Until every sentinel names ``master`` and knows the other sentinels and every
        replica (the ones it can promote)."""
        deadline = time.monotonic() + within_s
        while True:
            ok = True
            for port in self.sentinel_ports:
                try:
                    with redis.Redis(port=port, socket_timeout=1, **self._kw) as c:
                        state = c.sentinel_master(self.name)
                    if (
                        int(state["port"]) != master
                        or int(state["num-other-sentinels"]) < len(self.sentinel_ports) - 1
                        or int(state["num-slaves"]) < self.replicas
                    ):
                        ok = False
                except redis.exceptions.RedisError:
                    ok = False
            if ok:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the sentinels did not agree on the master")
            time.sleep(0.1)

    def cut_replication(self, replica: int, sleep_s: float) -> threading.Thread:
        """Make ``replica`` drop its link to the master, then sleep ``sleep_s`` (DEBUG SLEEP:
        it cannot reconnect meanwhile), so that the master acknowledges writes it never
        gets: what an asynchronous replica misses when its master dies.  Needs the servers
        started with ``--enable-debug-command local``.  Returns once both commands are sent;
        the thread returned ends with the sleep."""

        killed = threading.Event()

        # Both commands in one write: the replica drops the link and starts sleeping in the
        # same turn of its event loop, with no chance to reconnect in between.
        packed = _resp("CLIENT", "KILL", "TYPE", "master") + _resp("DEBUG", "SLEEP", str(sleep_s))

        def run() -> None:
            with socket.create_connection(("127.0.0.1", replica), timeout=sleep_s + 5) as sock:
                sock.sendall(packed)
                killed.set()  # (the replies come once the sleep is over)
                first = b""
                while b"+OK" not in first:
                    more = sock.recv(64)
                    if not more:
                        break
                    first += more

        t = threading.Thread(target=run, daemon=True)
        t.start()
        if not killed.wait(10):
            raise RuntimeError(f"replica {replica} did not drop its link")
        return t

    def kill(self, port: int) -> None:
        """SIGKILL the redis-server on ``port``."""
        proc = self.procs[port]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def wait_new_master(self, old: int, within_s: float = 30.0) -> tuple[int, float]:
        """(new master's port, monotonic time its promotion was seen: it answers as master)."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                port = self.master_port()
            except RuntimeError:
                port = old
            if port != old:
                try:
                    with redis.Redis(port=port, socket_timeout=1, **self._kw) as c:
                        if c.info("replication")["role"] == "master":
                            return port, time.monotonic()
                except redis.exceptions.RedisError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError("no new master was promoted")
            time.sleep(0.01)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def port_with_bus() -> int:
    """A free port whose cluster-bus port (port + 10000) is valid and free too."""
    while True:
        p = free_port()
        if p + 10000 <= 65535 and not port_in_use(p + 10000):
            return p


class HaCluster:
    """A Redis Cluster of ``primaries`` primaries with one replica each (``redis-cli --cluster
    create --cluster-replicas 1``), ``cluster-node-timeout`` ``node_timeout_ms``."""

    def __init__(
        self,
        workdir: Path,
        *,
        primaries: int = 3,
        node_timeout_ms: int = 2000,
        extra: list[str] | None = None,
    ) -> None:
        binary = _binary()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed")
        self.ports = [port_with_bus() for _ in range(primaries * 2)]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        for p in self.ports:
            d = workdir / str(p)
            d.mkdir(parents=True)
            self.procs[p] = spawn(
                [
                    binary,
                    *("--port", str(p), "--bind", "127.0.0.1"),
                    *("--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf")),
                    *("--cluster-node-timeout", str(node_timeout_ms)),
                    *("--save", "", "--appendonly", "no", "--dir", str(d)),
                    *(extra or []),
                ],
                d / "log",
            )
        try:
            for p in self.ports:
                wait_ping(p)
            subprocess.run(  # noqa: S603 - the system's redis-cli
                [
                    cli,
                    "--cluster",
                    "create",
                    *[f"127.0.0.1:{p}" for p in self.ports],
                    *("--cluster-replicas", "1", "--cluster-yes"),
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
            self.wait_ok()
            deadline = time.monotonic() + 20
            while len(self.replicas_online()) < primaries:
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster's replicas did not come online")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def _any(self, avoid: set[int] | None = None) -> redis.Redis:
        for p in self.ports:
            if p in (avoid or set()) or self.procs[p].poll() is not None:
                continue
            return redis.Redis(port=p, socket_timeout=1, decode_responses=True)
        raise RuntimeError("no node alive")

    def wait_ok(self, within_s: float = 30.0, avoid: set[int] | None = None) -> None:
        deadline = time.monotonic() + within_s
        while True:
            try:
                with self._any(avoid) as c:
                    if c.cluster("info").get("cluster_state") == "ok":
                        return
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach state ok")
            time.sleep(0.05)

    def primary_of(self, key: str, avoid: set[int] | None = None) -> int:
        """The port of the primary serving ``key``'s slot, as a live node sees it."""
        with self._any(avoid) as c:
            slot = int(c.cluster("keyslot", key))
            for start, end, primary, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if int(start) <= slot <= int(end):
                    return int(primary[1])
        raise RuntimeError(f"slot of {key!r} not served")

    def replica_of(self, primary: int) -> int:
        with redis.Redis(port=primary, socket_timeout=1) as c:
            info = c.info("replication")
        for k, v in info.items():
            if k.startswith("slave") and isinstance(v, dict):
                return int(v["port"])
        raise RuntimeError(f"{primary} has no replica")

    def replicas_online(self) -> list[int]:
        out = []
        for p in self.ports:
            try:
                with redis.Redis(port=p, socket_timeout=1) as c:
                    info = c.info("replication")
                if info.get("role") == "slave" and info.get("master_link_status") == "up":
                    out.append(p)
            except redis.exceptions.RedisError:
                continue
        return out

    def cut_replication(self, replica: int, sleep_s: float) -> threading.Thread:
        """As :meth:`SentinelGroup.cut_replication`."""
        return SentinelGroup.cut_replication(self, replica, sleep_s)  # type: ignore[arg-type]

    def kill(self, port: int) -> None:
        os.kill(self.procs[port].pid, signal.SIGKILL)
        self.procs[port].wait(10)

    def failover(self, replica: int) -> None:
        """A graceful failover: ``CLUSTER FAILOVER`` (no option) sent to ``replica``."""
        with redis.Redis(port=replica, socket_timeout=5) as c:
            c.execute_command("CLUSTER", "FAILOVER")

    def wait_new_primary(self, key: str, old: int, within_s: float = 30.0) -> tuple[int, float]:
        """(port of the new primary of ``key``'s slot, monotonic time it answered as one)."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                port = self.primary_of(key, avoid={old})
                if port != old:
                    with redis.Redis(port=port, socket_timeout=1) as c:
                        if c.info("replication")["role"] == "master":
                            return port, time.monotonic()
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("no new primary was promoted")
            time.sleep(0.01)

    def stop(self) -> None:
        SentinelGroup.stop(self)  # type: ignore[arg-type]
