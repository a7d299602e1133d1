"""``ai-quota up`` as ``scripts/run`` starts it: a quiet terminal (banner, URLs, one line per
decision), every process's output in the workdir, ``stack.json`` with the addresses, and a Redis
with AOF so a Redis restart keeps the tenants' counters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from extproc.commands.log_tail import format_log_line
from extproc.stack import free_port, port_in_use
from tests.helpers import settled

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[2]


def run_of(n: int) -> int:
    while True:
        p = free_port()
        if not any(port_in_use(p + i) for i in range(n)):
            return p


def test_format_log_line_shows_decisions_and_problems_only() -> None:
    """Decisions and warnings make one line each; routine info lines are hidden."""
    line = format_log_line(
        '{"event":"decision","decision":"admitted","tenant":"t","key":"k","model":"m",'
        '"input_tokens":9,"level":"info","timestamp":"2026-01-01T10:11:12.1Z"}'
    )
    assert line is not None
    assert "admitted" in line and "tenant=t" in line and "input_tokens=9" in line
    assert line.startswith("10:11:12")
    assert format_log_line('{"event":"serving","level":"info"}') is None
    warn = format_log_line('{"event":"redis_not_answering_yet","level":"warning"}')
    assert warn is not None and "WARNING" in warn


def test_up_is_quiet_writes_stack_json_and_redis_keeps_counters(tmp_path: Path) -> None:
    workdir = tmp_path / ".run"  # where `ai-quota usage` run in tmp_path looks
    envoy, admin = run_of(1), run_of(1)
    sim, extproc, rport = free_port(), free_port(), free_port()
    out = (tmp_path / "terminal.txt").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "extproc",
            "up",
            "--port",
            str(envoy),
            "--admin-port",
            str(admin),
            "--sim-port",
            str(sim),
            "--extproc-port",
            str(extproc),
            "--redis-port",
            str(rport),
            "--workdir",
            str(workdir),
        ],
        cwd=ROOT,
        env=dict(os.environ),
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    try:
        state = workdir / "stack.json"
        deadline = time.monotonic() + 60
        while not state.exists():
            assert proc.poll() is None, (tmp_path / "terminal.txt").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        info = json.loads(state.read_text())
        assert info["envoy_url"] == f"http://127.0.0.1:{envoy}/v1"
        assert info["extproc"] == info["usage"] == f"127.0.0.1:{extproc}"
        assert info["redis_url"] == f"redis://127.0.0.1:{rport}/0"
        assert {"envoy_admin", "sim_url", "metrics_port", "workdir", "config", "pid"} <= set(info)

        body = {
            "model": "sim-small",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
        }
        headers = {"authorization": "Bearer sk-demo-standard"}
        # The demo's windows are minutes and counters expire 2 s after theirs ends: start early
        # in a minute so the counters still exist when the restarted Redis is read below (the
        # stop drains for its notice and a busy machine is slow: leave it 30 s of the minute).
        if time.time() % 60 > 30:  # (a wait for the clock's own event: the next minute)
            time.sleep(61 - time.time() % 60)
        r = httpx.post(f"{info['envoy_url']}/chat/completions", json=body, headers=headers)
        assert r.status_code == 200

        rds = redis.Redis(port=rport, decode_responses=True)
        settled(rds, "demo-standard")  # the counters as settlement leaves them
        keys = [k for k in rds.keys("*") if ":req:" not in k]
        before = {k: rds.get(k) for k in keys if rds.type(k) == "string"}
        assert before
        # appendfsync everysec: wait until the append-only files hold every counter
        deadline = time.monotonic() + 15
        while not all(str(k).encode() in aof_bytes(workdir) for k in before):
            assert time.monotonic() < deadline, sorted(p.name for p in workdir.iterdir())
            time.sleep(0.1)
        # the decision line reaches the terminal
        while "admitted" not in (terminal := (tmp_path / "terminal.txt").read_text()):
            assert time.monotonic() < deadline, terminal[-2000:]
            time.sleep(0.1)
        assert "ai-quota is up." in terminal
        assert '"status"' not in terminal  # Envoy's JSON access log is not on the terminal
        assert "Ready to accept connections" not in terminal  # nor the Redis banner
        assert (workdir / "redis.log").read_text().count("Ready to accept") >= 1
        assert '"status"' in (workdir / "envoy0.log").read_text()
        # the port is closed (TLS, credentials recorded in stack.json) and `ai-quota usage`
        # still works without flags: it reads the stack's CA and admin token
        assert info["security"] == "token" and Path(info["credentials"]["ca"]).is_file()
        plain = {k: v for k, v in os.environ.items() if not k.startswith("AIQ_")}
        for args in (["--tenant", "demo-standard"], ["--key", "sk-demo-standard"]):
            shown = subprocess.run(
                [sys.executable, "-m", "extproc", "usage", *args, "--json"],
                cwd=tmp_path,
                env=plain,
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            assert shown.returncode == 0, shown.stderr
            assert json.loads(shown.stdout)["tenant"] == "demo-standard"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
        out.close()
    assert not (workdir / "stack.json").exists()
    # A Redis started again on the same directory loads the AOF: the counters are back.
    p2 = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(rport),
            "--bind",
            "127.0.0.1",
            "--appendonly",
            "yes",
            "--save",
            "",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        rds = redis.Redis(port=rport, decode_responses=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                rds.ping()
                break
            except redis.exceptions.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        while rds.info("persistence").get("loading"):
            time.sleep(0.05)
        after = {k: rds.get(k) for k in before}
        assert after == before
    finally:
        p2.terminate()
        p2.wait(10)


def aof_bytes(workdir: Path) -> bytes:
    """Everything Redis's append-only files under ``workdir`` hold (one file, or Redis 7's
    appendonlydir of base and increment files)."""
    files = [p for p in workdir.glob("appendonly*") if p.is_file()]
    files += [p for d in workdir.glob("appendonly*") if d.is_dir() for p in d.iterdir()]
    return b"".join(p.read_bytes() for p in files if p.is_file())
