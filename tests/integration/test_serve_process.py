"""`ai-quota serve` as a process: Prometheus metrics, the usage API, a clean SIGTERM exit."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from extproc._gen.aiquota.v1 import usage_pb2, usage_pb2_grpc
from extproc.stack import free_port
from tests.helpers import RedisServer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_serve_exposes_metrics_and_usage_and_stops_cleanly(redis_server: RedisServer) -> None:
    """Metrics on AIQ_METRICS_PORT, the usage API on the gRPC port, exit 0 on SIGTERM."""
    grpc_port, metrics_port = free_port(), free_port()
    env = {
        **os.environ,
        "AIQ_CONFIG": str(ROOT / "config/demo.yaml"),
        "AIQ_REDIS_URL": redis_server.url,
        "AIQ_INSECURE": "1",  # this test is about something else than the door
        "AIQ_GRPC_ADDRESS": f"127.0.0.1:{grpc_port}",
        "AIQ_METRICS_PORT": str(metrics_port),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "extproc", "serve"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 20
        body = ""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{metrics_port}/metrics", timeout=1
                ) as r:
                    body = r.read().decode()
                break
            except OSError:
                time.sleep(0.1)
        assert "aiq_decisions" in body and "aiq_active_streams" in body
        # the version of the rules in force, the same in the metrics and the usage API
        (version,) = re.findall(r'aiq_config_version_info\{version="([0-9a-f]+)"\} 1\.0', body)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            resp = usage_pb2_grpc.UsageStub(ch).GetUsage(
                usage_pb2.GetUsageRequest(api_key="sk-demo-tight"), timeout=10
            )
        assert resp.tenant == "demo-tight" and resp.plan == "tight"
        assert {(b.metric, b.limit) for b in resp.buckets} == {("rpm", 5), ("tpm", 2000)}
        assert resp.config_version == version
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out.decode(errors="replace")[-2000:]
    assert b'"stopped"' in out


def test_serve_with_an_invalid_config_exits_1(tmp_path: Path) -> None:
    """A broken rules file stops start-up with the file and path named."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: {}\n")
    env = {
        **os.environ,
        "AIQ_CONFIG": str(bad),
        "AIQ_GRPC_ADDRESS": f"127.0.0.1:{free_port()}",
        "AIQ_INSECURE": "1",
    }
    p = subprocess.run(
        [sys.executable, "-m", "extproc", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert p.returncode == 1
    assert f"{bad}:1:1: models: " in p.stderr


def test_serve_without_credentials_refuses_to_start(tmp_path: Path) -> None:
    """Neither a caller credential nor --insecure: exit 2 saying what to set, nothing served."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIQ_")}
    env["AIQ_GRPC_ADDRESS"] = f"127.0.0.1:{free_port()}"
    p = subprocess.run(
        [sys.executable, "-m", "extproc", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert p.returncode == 2
    assert "ai-quota serve: the gRPC port (ext_proc, RLS, usage) needs caller credentials" in (
        p.stderr
    )
    assert "--insecure or AIQ_INSECURE=1" in p.stderr
    off_loopback = subprocess.run(
        [sys.executable, "-m", "extproc", "serve", "--grpc-token-file", str(tmp_path / "t")],
        env={**env, "AIQ_GRPC_ADDRESS": "0.0.0.0:1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert off_loopback.returncode == 2 and "in plaintext" in off_loopback.stderr


@pytest.mark.parametrize(
    ("role", "flags", "what"),
    [
        ("grpc", [], "ext_proc gRPC API"),
        ("admin", ["--admin-port", "{port}", "--admin-token-file", "{token}"], "admin API"),
        ("metrics", ["--metrics-port", "{port}"], "Prometheus metrics"),
        ("metrics", ["--metrics-port", "{port}", "--workers", "2"], "Prometheus metrics"),
    ],
    ids=["grpc", "admin", "metrics", "metrics-workers"],
)
def test_serve_with_a_port_in_use_exits_2_naming_it(
    redis_server: RedisServer, tmp_path: Path, role: str, flags: list[str], what: str
) -> None:
    """A port already taken stops start-up with exit 2 and one line naming the address."""
    token = tmp_path / "admin-token"
    token.write_text("t-" + "x" * 40 + "\n")
    token.chmod(0o600)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = int(taken.getsockname()[1])
        grpc_port = busy if role == "grpc" else free_port()
        env = {
            **os.environ,
            "AIQ_CONFIG": str(ROOT / "config/demo.yaml"),
            "AIQ_REDIS_URL": redis_server.url,
            "AIQ_INSECURE": "1",  # this test is about something else than the door
            "AIQ_GRPC_ADDRESS": f"127.0.0.1:{grpc_port}",
        }
        args = [f.format(port=busy, token=token) for f in flags]
        try:
            p = subprocess.run(
                [sys.executable, "-m", "extproc", "serve", *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=30,  # it used to hang here: what start-up had built was never closed
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"serve did not exit with its {role} port in use: {exc.stderr!r}")
    assert p.returncode == 2, p.stderr[-2000:]
    mine = [line for line in p.stderr.splitlines() if line.startswith("ai-quota serve:")]
    assert mine == [
        f"ai-quota serve: cannot listen on 127.0.0.1:{busy} for the {what}: Address already in use"
    ]
    assert "Traceback" not in p.stderr
