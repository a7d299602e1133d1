"""A real Prometheus scraping two real ``ai-quota serve`` replicas, with the repo's alert rules
and dashboard queries: the metrics the processes export are the ones the rules and panels
read (names, labels, types), so alerts fire on a real fault and every panel query returns
data.  Faults: the replicas run different rules files (versions differ), a rules reload fails
on one, then Redis freezes while the replicas are idle (the admin store and Redis unreachable).  The rules' ``for:`` durations are set to 0 here so the
test does not wait for them (promtool tests the durations: test_alert_rules.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.app import CONFIG_HEALTH, REDIS_HEALTH
from extproc.stack import free_port
from tests.helpers import RedisServer, spawn
from tests.unit.test_deploy_observability import _as_prometheus_sees_it, dashboard_exprs

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "ai-quota-alerts.yaml"


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:  # loopback
        return json.loads(r.read())


class Prometheus:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}/api/v1"

    def query(self, expr: str) -> list[Any]:
        res = get(f"{self.base}/query?query={urllib.parse.quote(expr)}")
        assert res["status"] == "success", res
        data: list[Any] = res["data"]["result"]
        return data

    def firing(self) -> dict[str, list[dict[str, str]]]:
        out: dict[str, list[dict[str, str]]] = {}
        for alert in get(f"{self.base}/alerts")["data"]["alerts"]:
            if alert["state"] == "firing":
                out.setdefault(alert["labels"]["alertname"], []).append(alert["labels"])
        return out

    def until(self, check: Any, what: str, within_s: float = 30) -> Any:
        deadline = time.monotonic() + within_s
        while True:
            try:
                got = check()
            except OSError:
                got = None
            if got:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {within_s} s")
            time.sleep(0.5)


def health(port: int, service: str) -> str:
    """A replica's ``grpc.health.v1`` status for ``service``."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    yield server
    os.kill(server.proc.pid, signal.SIGCONT)
    server.stop()


def test_prometheus_fires_the_repos_alerts_on_real_replicas(
    own_redis: RedisServer, tmp_path: Path
) -> None:
    prometheus_bin = shutil.which("prometheus")
    if prometheus_bin is None:
        pytest.fail("prometheus is required (scripts/setup installs Debian's prometheus package)")
    demo = yaml.safe_load((ROOT / "config" / "demo.yaml").read_text())
    changed = yaml.safe_load((ROOT / "config" / "demo.yaml").read_text())
    changed["plans"]["tight"]["limits"][0]["rpm"] = 7  # replica b runs other rules
    files = []
    for name, doc in (("a", demo), ("b", changed)):
        path = tmp_path / f"rules-{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        files.append(path)

    procs: list[subprocess.Popen[bytes]] = []
    metrics_ports = []
    grpc_ports = []
    try:
        for path in files:
            port = free_port()
            metrics_ports.append(port)
            grpc_ports.append(free_port())
            env = {
                **os.environ,
                "AIQ_CONFIG": str(path),
                "AIQ_REDIS_URL": own_redis.url,
                "AIQ_INSECURE": "1",  # this test is about something else than the door
                "AIQ_GRPC_ADDRESS": f"127.0.0.1:{grpc_ports[-1]}",
                "AIQ_METRICS_PORT": str(port),
                "AIQ_USAGE_STREAM": "off",
            }
            procs.append(
                spawn(
                    [sys.executable, "-m", "extproc", "serve"],
                    tmp_path / f"serve-{port}.log",
                    env=env,
                )
            )
        # the repo's rules, evaluated at once
        rules = yaml.safe_load(ALERTS.read_text())
        for group in rules["groups"]:
            group["interval"] = "1s"
            for rule in group["rules"]:
                rule["for"] = "0s"
        (tmp_path / "alerts.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(tmp_path / "alerts.yaml")],
            "scrape_configs": [
                {
                    "job_name": "ai-quota",
                    "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in metrics_ports]}],
                }
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom_port = free_port()
        procs.append(
            spawn(
                [
                    prometheus_bin,
                    f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                ],
                tmp_path / "prometheus.log",
            )
        )
        prom = Prometheus(prom_port)
        prom.until(lambda: len(prom.query('up{job="ai-quota"} == 1')) == 2, "both replicas scraped")
        versions = prom.until(
            lambda: (
                prom.query("aiq_config_version_info == 1")
                if len(prom.query("aiq_config_version_info == 1")) == 2
                else None
            ),
            "both replicas' config versions",
        )
        assert len({v["metric"]["version"] for v in versions}) == 2
        firing = prom.until(
            lambda: prom.firing() if "AiQuotaConfigVersionsDiffer" in prom.firing() else None,
            "AiQuotaConfigVersionsDiffer firing",
        )
        assert firing["AiQuotaConfigVersionsDiffer"][0]["job"] == "ai-quota"
        assert "AiQuotaAdminStoreUnreachable" not in firing

        # every dashboard query evaluates on the real series (none is an error)
        for expr in dashboard_exprs():
            prom.query(_as_prometheus_sees_it(expr))
        assert prom.query('aiq_admin_store_reachable{job="ai-quota"} == 1')

        assert "AiQuotaRedisUnreachable" not in firing
        assert "AiQuotaConfigReloadFailed" not in firing
        assert [health(p, CONFIG_HEALTH) for p in grpc_ports] == ["SERVING"] * 2

        # a reload of replica a that fails: its alert fires (and only its), its Config health
        # turns NOT_SERVING; a reload that works resolves both
        files[0].write_text("models: [not, a, mapping\n")
        procs[0].send_signal(signal.SIGHUP)
        firing = prom.until(
            lambda: prom.firing() if "AiQuotaConfigReloadFailed" in prom.firing() else None,
            "AiQuotaConfigReloadFailed firing",
        )
        assert [a["instance"] for a in firing["AiQuotaConfigReloadFailed"]] == [
            f"127.0.0.1:{metrics_ports[0]}"
        ]
        assert [health(p, CONFIG_HEALTH) for p in grpc_ports] == ["NOT_SERVING", "SERVING"]
        files[0].write_text(yaml.safe_dump(demo, sort_keys=False))
        procs[0].send_signal(signal.SIGHUP)
        prom.until(
            lambda: "AiQuotaConfigReloadFailed" not in prom.firing(),
            "AiQuotaConfigReloadFailed resolved by a reload that works",
        )
        assert health(grpc_ports[0], CONFIG_HEALTH) == "SERVING"

        # Redis freezes while no request comes in: both replicas' admin store polls fail, and
        # their health PINGs: the Redis alert fires for idle replicas too
        os.kill(own_redis.proc.pid, signal.SIGSTOP)
        both = {f"127.0.0.1:{p}" for p in metrics_ports}
        for alert in ("AiQuotaAdminStoreUnreachable", "AiQuotaRedisUnreachable"):
            firing = prom.until(
                lambda a=alert: prom.firing() if len(prom.firing().get(a, [])) == 2 else None,
                f"{alert} firing for both replicas",
            )
            assert {a["instance"] for a in firing[alert]} == both
        assert [health(p, REDIS_HEALTH) for p in grpc_ports] == ["NOT_SERVING"] * 2
        assert not prom.query('sum(aiq_redis_call_seconds_count{job="ai-quota"}) > 0')  # idle
        os.kill(own_redis.proc.pid, signal.SIGCONT)
        for alert in ("AiQuotaAdminStoreUnreachable", "AiQuotaRedisUnreachable"):
            prom.until(
                lambda a=alert: a not in prom.firing(), f"{alert} resolved once Redis answers"
            )
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
