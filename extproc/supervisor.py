"""``ai-quota serve --workers N``: a parent that supervises N single-process servers.

- Each worker is ``python -m extproc serve`` with ``AIQ_WORKERS=1`` and its own asyncio server.
  By default every worker listens on the same address with ``SO_REUSEPORT`` (the kernel spreads
  *connections*, so Envoy needs several connections to the cluster to use every worker); with
  ``port_per_worker`` worker *i* listens on ``port + i`` and Envoy lists each as an endpoint.
- A worker that exits while the parent is not stopping is started again after a back-off
  (0.5 s doubling to 10 s; reset once a worker has run 30 s).
- SIGHUP is forwarded to every worker (each reloads its rules); SIGTERM/SIGINT are forwarded as
  SIGTERM (each drains), and the parent exits once every worker has exited (status 0 when each
  drained cleanly).
- Metrics: with ``metrics_port``, workers write to a shared ``PROMETHEUS_MULTIPROC_DIR`` and the
  parent alone serves the merged metrics on ``metrics_host:metrics_port`` (counters and histograms
  summed over workers; gauges carry a ``pid`` label per worker).  A dead worker's files are
  marked dead when it is replaced.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger("extproc.supervisor")

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 10.0
HEALTHY_RUN_S = 30.0


@dataclass
class Worker:
    """One supervised worker process."""

    index: int
    address: str
    popen: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    backoff_s: float = BACKOFF_START_S
    restart_at: float | None = None
    restarts: int = 0


@dataclass
class Supervisor:
    """Start, watch, restart and signal the workers (see the module docstring)."""

    settings: Any  # extproc.settings.Settings
    port_per_worker: bool = False
    workers: list[Worker] = field(default_factory=list)
    stopping: bool = False
    _reload: bool = False
    _multiproc_dir: str | None = None

    def addresses(self) -> list[str]:
        """The address each worker listens on."""
        host, _, port = self.settings.grpc_address.rpartition(":")
        n = self.settings.workers
        if self.port_per_worker:
            return [f"{host}:{int(port) + i}" for i in range(n)]
        return [self.settings.grpc_address] * n

    def _env(self, w: Worker) -> dict[str, str]:
        s = self.settings
        env = {
            **os.environ,
            "AIQ_CONFIG": s.config,
            "AIQ_REDIS_URL": s.redis_url,
            "AIQ_GRPC_ADDRESS": w.address,
            "AIQ_LOG_FORMAT": s.log_format,
            "AIQ_WORKERS": "1",
            "AIQ_REUSEPORT": "0" if self.port_per_worker else "1",
            "AIQ_WORKER_INDEX": str(w.index),
            "AIQ_METRICS_PORT": "0",
            "AIQ_SHUTDOWN_GRACE_S": str(s.shutdown_grace_s),
            "AIQ_DRAIN_NOTICE_S": str(s.drain_notice_s),
            "AIQ_ADMIN_STORE": "1" if s.admin_store else "0",
            # every worker follows the admin store; the first alone serves the admin API
            "AIQ_ADMIN_PORT": str(s.admin_port if w.index == 0 else 0),
            "AIQ_ADMIN_HOST": s.admin_host,
            "AIQ_ADMIN_TOKEN_FILE": s.admin_token_file,
            "AIQ_ADMIN_TLS_CERT": s.admin_tls_cert,
            "AIQ_ADMIN_TLS_KEY": s.admin_tls_key,
            "AIQ_ADMIN_TLS_CLIENT_CA": s.admin_tls_client_ca,
            "AIQ_ADMIN_ALLOW_PLAINTEXT": "1" if s.admin_allow_plaintext else "0",
            # the RLS API (docs/rls.md): every worker serves it; its own port per worker too
            "AIQ_RLS_CONFIG": s.rls_config,
            "AIQ_RLS_ADDRESS": _nth_address(s.rls_address, w.index)
            if self.port_per_worker
            else s.rls_address,
            # the port's door (docs/security.md): flags become variables for the workers
            "AIQ_INSECURE": "1" if s.insecure else "0",
            "AIQ_GRPC_TOKEN_FILE": s.grpc_token_file,
            "AIQ_GRPC_TLS_CERT": s.grpc_tls_cert,
            "AIQ_GRPC_TLS_KEY": s.grpc_tls_key,
            "AIQ_GRPC_TLS_CLIENT_CA": s.grpc_tls_client_ca,
            "AIQ_GRPC_ALLOWED_SANS": s.grpc_allowed_sans,
            "AIQ_GRPC_ALLOW_PLAINTEXT": "1" if s.grpc_allow_plaintext else "0",
            # health-only port: the first worker alone (the others would clash on it)
            "AIQ_HEALTH_ADDRESS": s.health_address if w.index == 0 else "",
        }
        if self._multiproc_dir:
            env["PROMETHEUS_MULTIPROC_DIR"] = self._multiproc_dir
        return env

    def _start(self, w: Worker) -> None:
        w.popen = subprocess.Popen(  # our own interpreter and module
            [sys.executable, "-m", "extproc", "serve"], env=self._env(w)
        )
        w.started_at = time.monotonic()
        w.restart_at = None
        log.info("worker_started", worker=w.index, pid=w.popen.pid, address=w.address)

    def _serve_metrics(self) -> None:
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        from extproc.ports import serve_metrics

        assert self._multiproc_dir is not None
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self._multiproc_dir)  # type: ignore[no-untyped-call]
        serve_metrics(self.settings.metrics_port, self.settings.metrics_host, registry)

    def _on_exit(self, w: Worker, code: int) -> None:
        assert w.popen is not None
        pid = w.popen.pid
        if self._multiproc_dir:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid, self._multiproc_dir)  # type: ignore[no-untyped-call]
        ran = time.monotonic() - w.started_at
        if ran >= HEALTHY_RUN_S:
            w.backoff_s = BACKOFF_START_S
        w.restart_at = time.monotonic() + w.backoff_s
        log.warning("worker_exited", worker=w.index, pid=pid, status=code, restart_in_s=w.backoff_s)
        w.backoff_s = min(w.backoff_s * 2, BACKOFF_MAX_S)
        w.popen = None

    def _signal_all(self, sig: int) -> None:
        for w in self.workers:
            if w.popen is not None and w.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    w.popen.send_signal(sig)

    def run(self) -> int:
        """Supervise until SIGTERM/SIGINT and every worker has exited; the exit status."""
        if self.settings.metrics_port:
            self._multiproc_dir = tempfile.mkdtemp(prefix="aiq-metrics-")
        self.workers = [Worker(i, a) for i, a in enumerate(self.addresses())]

        def on_stop(_s: int, _f: object) -> None:
            self.stopping = True

        def on_hup(_s: int, _f: object) -> None:
            self._reload = True

        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGHUP, on_hup)
        try:
            if self._multiproc_dir:
                self._serve_metrics()
            for w in self.workers:
                self._start(w)
            return self._loop()
        finally:
            if self._multiproc_dir:
                shutil.rmtree(self._multiproc_dir, ignore_errors=True)

    def _loop(self) -> int:
        forwarded_stop = False
        statuses: dict[int, int] = {}
        while True:
            if self._reload:
                self._reload = False
                log.info("reload_forwarded", workers=len(self.workers))
                self._signal_all(signal.SIGHUP)
            if self.stopping and not forwarded_stop:
                forwarded_stop = True
                log.info("stopping_workers", workers=len(self.workers))
                self._signal_all(signal.SIGTERM)
            now = time.monotonic()
            alive = 0
            for w in self.workers:
                if w.popen is not None:
                    code = w.popen.poll()
                    if code is None:
                        alive += 1
                        continue
                    if self.stopping:
                        statuses[w.index] = code
                        w.popen = None
                        continue
                    self._on_exit(w, code)
                elif not self.stopping and w.restart_at is not None and now >= w.restart_at:
                    w.restarts += 1
                    self._start(w)
                    alive += 1
            if self.stopping and alive == 0:
                bad = {i: c for i, c in statuses.items() if c != 0}
                log.info("workers_stopped", statuses={str(i): c for i, c in statuses.items()})
                return 1 if bad else 0
            time.sleep(0.05)


def _nth_address(address: str, index: int) -> str:
    """``host:port`` moved ``index`` ports up ("" stays "")."""
    if not address:
        return ""
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + index}"
