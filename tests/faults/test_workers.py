"""``ai-quota serve --workers 2 --port-per-worker --metrics-port M`` as an operator runs it: a
worker killed with SIGKILL is restarted, SIGHUP puts every worker on the new rules (seen in the
merged metrics), SIGTERM drains them and the parent exits 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.stack import free_port, port_in_use
from tests.helpers import RedisServer

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[2]


def wait_for(what: str, cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def serving(port: int) -> bool:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            res = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            return bool(res.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def children(pid: int) -> set[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return {int(x) for x in text.split()}


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        return str(r.read().decode())


def versions_by_pid(text: str) -> dict[int, str]:
    """pid -> the config version it reports 1 for."""
    out = {}
    for m in re.finditer(r"aiq_config_version_info\{([^}]*)\} 1\.0", text):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[int(labels["pid"])] = labels["version"]
    return out


def free_run(n: int) -> int:
    while True:
        p = free_port()
        if not any(port_in_use(p + i) for i in range(n)):
            return p


def test_supervised_workers_restart_reload_and_drain(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text((ROOT / "config/demo.yaml").read_text())
    port, mport = free_run(2), free_port()
    env = {
        **os.environ,
        "AIQ_CONFIG": str(rules),
        "AIQ_REDIS_URL": redis_server.url,
        "AIQ_INSECURE": "1",  # this test is about something else than the door
        "AIQ_DRAIN_NOTICE_S": "0.2",
        "AIQ_SHUTDOWN_GRACE_S": "3",
    }
    log = (tmp_path / "serve.log").open("wb")
    parent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "extproc",
            "serve",
            "--workers",
            "2",
            "--port-per-worker",
            "--grpc-address",
            f"127.0.0.1:{port}",
            "--metrics-port",
            str(mport),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for("both workers serving", lambda: serving(port) and serving(port + 1))
        first = children(parent.pid)
        assert len(first) == 2
        wait_for(
            "merged metrics of both workers", lambda: set(versions_by_pid(metrics(mport))) >= first
        )
        v0 = versions_by_pid(metrics(mport))
        assert len({v0[p] for p in first}) == 1

        # A worker killed with SIGKILL is replaced and serves its port again.
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        wait_for("a replacement worker", lambda: len(children(parent.pid) - first) == 1)
        wait_for("both ports serving again", lambda: serving(port) and serving(port + 1))
        now = children(parent.pid)
        assert victim not in now and len(now) == 2

        # SIGHUP: every worker reloads the changed rules (a new version hash in the metrics).
        rules.write_text(rules.read_text() + "\n# reload marker\nledger_ttl_seconds: 7200\n")
        parent.send_signal(signal.SIGHUP)

        def all_new() -> bool:
            v = versions_by_pid(metrics(mport))
            return all(p in v and v[p] != v0[min(first - {victim})] for p in now)

        wait_for("every worker on the new rules", all_new, timeout=15)
        assert parent.poll() is None  # SIGHUP no longer kills the parent

        # SIGTERM: workers drain, the parent exits 0.
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(30) == 0
        assert not any(Path(f"/proc/{p}").exists() for p in now)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        log.close()
