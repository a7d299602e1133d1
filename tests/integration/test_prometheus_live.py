"""A real Prometheus scraping two real ``ai-quota serve`` replicas, with the repo's alert rules
and dashboard queries: the metrics the processes export are the ones the rules and panels
read (names, labels, types), so alerts fire on a real fault and every panel query returns
data.  Faults: the replicas run different rules files (versions differ), then Redis freezes
(the admin store becomes unreachable).  The rules' ``for:`` durations are set to 0 here so the
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

import pytest
import yaml

from extproc.stack import free_port
from tests.helpers import RedisServer
from tests.unit.test_deploy_observability import _as_prometheus_sees_it, dashboard_exprs

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "ai-quota-alerts.yaml"


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback
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
    try:
        for path in files:
            port = free_port()
            metrics_ports.append(port)
            env = {
                **os.environ,
                "AIQ_CONFIG": str(path),
                "AIQ_REDIS_URL": own_redis.url,
                "AIQ_GRPC_ADDRESS": f"127.0.0.1:{free_port()}",
                "AIQ_METRICS_PORT": str(port),
                "AIQ_USAGE_STREAM": "off",
            }
            procs.append(
                subprocess.Popen(  # noqa: S603
                    [sys.executable, "-m", "extproc", "serve"],
                    env=env,
                    stdout=(tmp_path / f"serve-{port}.log").open("wb"),
                    stderr=subprocess.STDOUT,
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
            subprocess.Popen(  # noqa: S603
                [
                    prometheus_bin,
                    f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                ],
                stdout=(tmp_path / "prometheus.log").open("wb"),
                stderr=subprocess.STDOUT,
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

        # Redis freezes: both replicas' admin store polls fail
        os.kill(own_redis.proc.pid, signal.SIGSTOP)
        firing = prom.until(
            lambda: (
                prom.firing()
                if len(prom.firing().get("AiQuotaAdminStoreUnreachable", [])) == 2
                else None
            ),
            "AiQuotaAdminStoreUnreachable firing for both replicas",
        )
        assert {a["instance"] for a in firing["AiQuotaAdminStoreUnreachable"]} == {
            f"127.0.0.1:{p}" for p in metrics_ports
        }
        os.kill(own_redis.proc.pid, signal.SIGCONT)
        prom.until(
            lambda: "AiQuotaAdminStoreUnreachable" not in prom.firing(),
            "AiQuotaAdminStoreUnreachable resolved once Redis answers",
        )
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
