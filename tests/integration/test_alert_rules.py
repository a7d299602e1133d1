"""deploy/prometheus/ai-quota-alerts.yaml in Prometheus's own rule engine: ``promtool check
rules`` accepts the file (PromQL and templates), and ``promtool test rules`` replays series a
failing replica would export and checks which alerts fire, when, and with which labels; the
same series from a healthy replica fire nothing.  (The metric names the rules use are checked
against extproc/metrics.py by tests/unit/test_deploy_observability.py.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "ai-quota-alerts.yaml"
JOB = 'job="ai-quota"'


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is required (scripts/setup installs Debian's prometheus package)")
    return path


def series(name: str, labels: str, values: str, instance: str = "a:9090") -> dict[str, str]:
    lbl = f'{JOB},instance="{instance}"' + (f",{labels}" if labels else "")
    return {"series": f"{name}{{{lbl}}}", "values": values}


def fires(alert: str, at: str, **labels: str) -> dict[str, Any]:
    want = {"severity": labels.pop("severity", "warning"), "job": "ai-quota", **labels}
    return {"eval_time": at, "alertname": alert, "exp_alerts": [{"exp_labels": want}]}


def silent(alert: str, at: str) -> dict[str, Any]:
    return {"eval_time": at, "alertname": alert, "exp_alerts": []}


# Each case: the series (one sample every 30 s) and what the alerts must do.
CASES: list[dict[str, Any]] = [
    {  # two replicas on different rules for more than 5 minutes
        "input_series": [
            series("aiq_config_version_info", 'version="1a2b3c4d5e6f"', "1x20"),
            series("aiq_config_version_info", 'version="99aa88bb77cc"', "1x20", "b:9090"),
        ],
        "alert_rule_test": [
            silent("AiQuotaConfigVersionsDiffer", "4m"),
            fires("AiQuotaConfigVersionsDiffer", "6m"),
        ],
    },
    {  # the breaker opens after a minute of success and stays open
        "input_series": [series("aiq_breaker_state", "", "0 0 2x10")],
        "alert_rule_test": [
            silent("AiQuotaBreakerOpen", "30s"),
            fires("AiQuotaBreakerOpen", "2m", severity="critical", instance="a:9090"),
        ],
    },
    {  # a new Redis master seen once (the journal replayed); a replica whose journal overflowed
        "input_series": [
            series("aiq_redis_failovers_total", "", "0 0 0 1x10"),
            series("aiq_journal_dropped", "", "0 0 0 50x10", "b:9090"),
        ],
        "alert_rule_test": [
            silent("AiQuotaRedisFailover", "1m"),
            fires("AiQuotaRedisFailover", "2m", severity="info", instance="a:9090"),
            fires("AiQuotaJournalOverflow", "2m", instance="b:9090"),
        ],
    },
    {  # nine of ten Redis calls failing
        "input_series": [
            series("aiq_redis_call_seconds_count", 'script="admit",outcome="ok"', "0+10x20"),
            series("aiq_redis_call_seconds_count", 'script="admit",outcome="error"', "0+90x20"),
        ],
        "alert_rule_test": [
            fires("AiQuotaRedisUnreachable", "5m", severity="critical", instance="a:9090"),
        ],
    },
    {  # an idle replica (no Redis calls at all) whose health PING fails; another that answers
        "input_series": [
            series("aiq_redis_reachable", "", "1 1 0x10"),
            series("aiq_redis_reachable", "", "1x12", "b:9090"),
        ],
        "alert_rule_test": [
            silent("AiQuotaRedisUnreachable", "1m"),
            fires("AiQuotaRedisUnreachable", "3m", severity="critical", instance="a:9090"),
        ],
    },
    {  # a reload fails and keeps firing (past any counter window) until one works
        "input_series": [
            series("aiq_config_reload_failed", "", "0 0 1x30 0x5"),
            series("aiq_config_reload_failed", "", "0x38", "b:9090"),
        ],
        "alert_rule_test": [
            silent("AiQuotaConfigReloadFailed", "30s"),
            fires("AiQuotaConfigReloadFailed", "2m", instance="a:9090"),
            fires("AiQuotaConfigReloadFailed", "15m", instance="a:9090"),
            silent("AiQuotaConfigReloadFailed", "17m"),
        ],
    },
    {  # a replica that cannot read the admin store; another that can
        "input_series": [
            series("aiq_admin_store_reachable", "", "1 1 0x10"),
            series("aiq_admin_store_reachable", "", "1x12", "b:9090"),
        ],
        "alert_rule_test": [
            silent("AiQuotaAdminStoreUnreachable", "1m"),
            fires("AiQuotaAdminStoreUnreachable", "4m", instance="a:9090"),
        ],
    },
    {  # someone trying tokens against the admin API
        "input_series": [
            series("aiq_admin_calls_total", 'method="CreateKey",code="UNAUTHENTICATED"', "0+3x10"),
            series("aiq_admin_calls_total", 'method="ListTenants",code="OK"', "0+50x10"),
        ],
        "alert_rule_test": [fires("AiQuotaAdminUnauthenticatedCalls", "2m")],
    },
    {  # an Envoy left on a retired token; refused usage reads alone do not page
        "input_series": [
            series("aiq_grpc_refused_total", 'service="ext_proc",reason="wrong_token"', "0+4x10"),
            series("aiq_grpc_refused_total", 'service="usage",reason="other_tenant"', "0+9x10"),
        ],
        "alert_rule_test": [
            fires("AiQuotaGrpcCallsRefused", "2m", service="ext_proc"),
            silent("AiQuotaGrpcCallsRefused", "30s"),
        ],
    },
    {  # lost settlements and lost usage records are critical at once
        "input_series": [
            series("aiq_settlements_total", 'outcome="dropped"', "0 0 5x5"),
            series("aiq_settlements_total", 'outcome="applied"', "0+100x8"),
            series("aiq_usage_records_total", 'outcome="dropped"', "0 0 0 2x5"),
        ],
        "alert_rule_test": [
            fires("AiQuotaSettlementsDropped", "2m", severity="critical", instance="a:9090"),
            fires("AiQuotaUsageRecordsDropped", "2m", severity="critical", instance="a:9090"),
        ],
    },
    {  # a full settlement backlog pushes back on admissions: critical at once
        "input_series": [
            series("aiq_settlement_pushback_total", 'outcome="refused"', "0 0 3x5"),
            series("aiq_settlements_total", 'outcome="applied"', "0+100x8"),
        ],
        "alert_rule_test": [
            silent("AiQuotaSettlementPushback", "30s"),
            fires("AiQuotaSettlementPushback", "2m", severity="critical", instance="a:9090"),
        ],
    },
    {  # a stream cut for a fault alerts; cuts by quota (the product working) do not
        "input_series": [
            series("aiq_stream_cuts_total", 'reason="unmeterable_response"', "0 0 1x5"),
            series("aiq_stream_cuts_total", 'reason="quota_exhausted"', "0+40x8"),
        ],
        "alert_rule_test": [
            fires("AiQuotaStreamsCutByFaults", "2m", reason="unmeterable_response"),
        ],
    },
    {  # settlements kept while Redis is away, and growing; usage records held for 5 minutes
        "input_series": [
            series("aiq_settlement_backlog", "", "0+3x30"),
            series("aiq_usage_record_backlog", "", "0 40x30"),
        ],
        "alert_rule_test": [
            silent("AiQuotaSettlementBacklogGrowing", "4m"),
            fires("AiQuotaSettlementBacklogGrowing", "12m", instance="a:9090"),
            fires("AiQuotaUsageRecordBacklog", "12m", instance="a:9090"),
        ],
    },
    {  # a healthy replica: traffic, refusals at their usual share, quota cuts, no faults
        "input_series": [
            series("aiq_config_version_info", 'version="1a2b3c4d5e6f"', "1x40"),
            series("aiq_config_version_info", 'version="1a2b3c4d5e6f"', "1x40", "b:9090"),
            series("aiq_breaker_state", "", "0x40"),
            series("aiq_redis_reachable", "", "1x40"),
            series("aiq_config_reload_failed", "", "0x40"),
            series("aiq_admin_store_reachable", "", "1x40"),
            series("aiq_redis_call_seconds_count", 'script="admit",outcome="ok"', "0+100x40"),
            series("aiq_redis_call_seconds_count", 'script="admit",outcome="error"', "0x40"),
            series("aiq_decisions_total", 'decision="admitted",code="ok"', "0+95x40"),
            series("aiq_decisions_total", 'decision="refused",code="tpm_limit_exceeded"', "0+5x40"),
            series("aiq_stream_cuts_total", 'reason="quota_exhausted"', "0+2x40"),
            series("aiq_settlements_total", 'outcome="applied"', "0+95x40"),
            series("aiq_settlement_backlog", "", "0x40"),
            series("aiq_usage_record_backlog", "", "0x40"),
            series("aiq_admin_calls_total", 'method="CreateKey",code="OK"', "0+1x40"),
            series("aiq_redis_failovers_total", "", "0x40"),
            series("aiq_journal_dropped", "", "0x40"),
        ],
        "alert_rule_test": [
            silent(name, "20m")
            for name in (
                "AiQuotaConfigVersionsDiffer",
                "AiQuotaBreakerOpen",
                "AiQuotaRedisUnreachable",
                "AiQuotaConfigReloadFailed",
                "AiQuotaAdminStoreUnreachable",
                "AiQuotaAdminUnauthenticatedCalls",
                "AiQuotaGrpcCallsRefused",
                "AiQuotaRefusalSpike",
                "AiQuotaStreamsCutByFaults",
                "AiQuotaSettlementsDropped",
                "AiQuotaSettlementPushback",
                "AiQuotaSettlementBacklogGrowing",
                "AiQuotaUsageRecordBacklog",
                "AiQuotaRedisFailover",
                "AiQuotaJournalOverflow",
            )
        ],
    },
]


def promtool_test(
    tmp_path: Path, rules: dict[str, Any], cases: list[dict[str, Any]]
) -> subprocess.CompletedProcess[str]:
    """``promtool test rules`` of ``cases`` against the rules document ``rules``."""
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "30s", "tests": cases}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    return subprocess.run(
        [promtool(), "test", "rules", "tests.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )


def test_promtool_accepts_the_rules_file() -> None:
    out = subprocess.run(
        [promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    count = len([r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]])
    assert f"SUCCESS: {count} rules found" in out.stdout


def test_alerts_fire_on_failing_replicas_and_stay_silent_on_healthy_ones(tmp_path: Path) -> None:
    # The rules as they are, less their annotations (prose for people; promtool would want
    # every rendered summary spelled out here): the expressions, durations and labels are
    # what is under test.
    doc = yaml.safe_load(ALERTS.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    out = promtool_test(tmp_path, doc, [{"interval": "30s", **case} for case in CASES])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_a_wrong_expectation_fails(tmp_path: Path) -> None:
    """The harness can fail: a healthy breaker is not an open one."""
    doc = yaml.safe_load(ALERTS.read_text())
    case = {
        "interval": "30s",
        "input_series": [series("aiq_breaker_state", "", "0x10")],
        "alert_rule_test": [fires("AiQuotaBreakerOpen", "4m", severity="critical")],
    }
    out = promtool_test(tmp_path, doc, [case])
    assert out.returncode != 0 and "FAILED" in out.stdout + out.stderr
