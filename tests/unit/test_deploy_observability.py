"""deploy/grafana and deploy/prometheus use only metrics (and labels) the gateway exports.

Every PromQL expression of the dashboard and of the alert rules is tokenized (string literals,
numbers, durations, identifiers, brackets); identifiers starting with ``aiq_`` are metric names
and must be sample names of :class:`extproc.metrics.Metrics`, and the label names in their
``{...}`` selectors must be labels of that metric (or target labels Prometheus adds).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from extproc.metrics import Metrics

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "ai-quota-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "ai-quota-alerts.yaml"

# Labels a scrape adds (target labels, Kubernetes discovery), ``le`` on histogram buckets is
# added per metric below, and ``pid`` on gauges with ``serve --workers``.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "service", "endpoint", "pid"}

_TOKEN = re.compile(
    r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<var>\$(?:\{[A-Za-z_:][\w:]*\}|[A-Za-z_][\w]*))
  | (?P<duration>\d+(?:ms|s|m|h|d|w|y)(?:\d+(?:ms|s|m|h|d|w|y))*)
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][\w:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=,])
  | (?P<open>[({\[])
  | (?P<close>[)}\]])
  | (?P<space>\s+)
    """,
    re.VERBOSE,
)
_PAIRS = {"(": ")", "{": "}", "[": "]"}


@dataclass(frozen=True)
class Selector:
    metric: str
    labels: frozenset[str]


class PromQLError(ValueError):
    pass


def tokens(expr: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise PromQLError(f"unexpected {expr[pos : pos + 20]!r} at {pos} in {expr!r}")
        kind = m.lastgroup
        assert kind is not None
        if kind != "space":
            out.append((kind, m.group()))
        pos = m.end()
    return out


def selectors(expr: str) -> list[Selector]:
    """The ``aiq_*`` metric selectors of a PromQL expression, with the label names their
    matchers use; raises :class:`PromQLError` on unbalanced brackets or a malformed matcher."""
    toks = tokens(expr)
    stack: list[str] = []
    for kind, text in toks:
        if kind == "open":
            stack.append(_PAIRS[text])
        elif kind == "close" and (not stack or stack.pop() != text):
            raise PromQLError(f"unbalanced {text!r} in {expr!r}")
    if stack:
        raise PromQLError(f"unclosed bracket in {expr!r}")
    found: list[Selector] = []
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        if kind == "ident" and text.startswith("aiq_"):
            labels: set[str] = set()
            if i + 1 < len(toks) and toks[i + 1] == ("open", "{"):
                j = i + 2
                while toks[j] != ("close", "}"):
                    name, op, value = toks[j], toks[j + 1], toks[j + 2]
                    if name[0] != "ident" or op[1] not in ("=", "!=", "=~", "!~"):
                        raise PromQLError(f"bad matcher after {text} in {expr!r}")
                    if value[0] not in ("string", "var"):
                        raise PromQLError(f"matcher value is not a string in {expr!r}")
                    labels.add(name[1])
                    j += 3
                    if toks[j] == ("op", ","):
                        j += 1
                i = j
            found.append(Selector(text, frozenset(labels)))
        i += 1
    return found


def exported() -> dict[str, frozenset[str]]:
    """Every sample name the gateway exports, with the labels each carries."""
    metrics = Metrics()
    out: dict[str, frozenset[str]] = {}
    for family in metrics.registry.collect():
        collector = next(
            c
            for c in vars(metrics).values()
            if isinstance(c, MetricWrapperBase) and c._name == family.name
        )
        labels = frozenset(collector._labelnames)
        if family.type == "counter":
            out[family.name + "_total"] = labels
        elif family.type == "histogram":
            out[family.name + "_bucket"] = labels | {"le"}
            out[family.name + "_sum"] = labels
            out[family.name + "_count"] = labels
        else:
            out[family.name] = labels
    return out


def unknown(exprs: list[str], known: dict[str, frozenset[str]]) -> list[str]:
    """One line per metric name or label the expressions use that ``known`` lacks."""
    problems = []
    for expr in exprs:
        for sel in selectors(expr):
            if sel.metric not in known:
                problems.append(f"unknown metric {sel.metric}")
                continue
            extra = sel.labels - known[sel.metric] - TARGET_LABELS
            if extra:
                problems.append(f"{sel.metric} has no label(s) {sorted(extra)}")
    return problems


def _walk_exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, dict) and isinstance(value.get("query"), str):
                yield value["query"]
            else:
                yield from _walk_exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _walk_exprs(item)


def _promql(expr: str) -> str:
    """A Grafana ``label_values(metric, label)`` query is checked as its metric selector."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", expr, re.S)
    return m.group(1) if m else expr


def dashboard_exprs() -> list[str]:
    return [_promql(e) for e in _walk_exprs(json.loads(DASHBOARD.read_text()))]


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


# -- the checker ------------------------------------------------------------------------------


def test_exported_names_follow_prometheus_client_suffixes() -> None:
    known = exported()
    assert {"aiq_decisions_total", "aiq_breaker_state", "aiq_config_version_info"} <= set(known)
    assert {"aiq_redis_call_seconds_bucket", "aiq_redis_call_seconds_count"} <= set(known)
    assert "aiq_decisions" not in known and "aiq_redis_call_seconds" not in known
    assert known["aiq_redis_call_seconds_bucket"] == {"script", "outcome", "le"}


def test_the_checker_catches_unknown_names_and_labels() -> None:
    known = exported()
    assert unknown(['sum(rate(aiq_decisions_total{code="x"}[5m]))'], known) == []
    assert unknown(["rate(aiq_no_such_metric_total[5m])"], known) == [
        "unknown metric aiq_no_such_metric_total"
    ]
    # the counter without its _total suffix is not a sample name
    assert unknown(["rate(aiq_decisions[5m])"], known) == ["unknown metric aiq_decisions"]
    assert unknown(['aiq_breaker_state{tenant="a"}'], known) == [
        "aiq_breaker_state has no label(s) ['tenant']"
    ]
    # a name inside a string literal is not a metric
    assert unknown(['aiq_breaker_state{job="aiq_fake"}'], known) == []
    with pytest.raises(PromQLError):
        selectors("sum(rate(aiq_decisions_total[5m])")


#: Grafana's variables, replaced by what Grafana would put there before PromQL sees them.
_GRAFANA_VARS = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "1h",
    "$job": ".*",
    "${datasource}": "prometheus",
}


def _as_prometheus_sees_it(expr: str) -> str:
    for var, value in _GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return expr


def test_every_expression_parses_as_promql() -> None:
    """Every dashboard query and alert expression is valid PromQL, by a full PromQL parser
    (the Rust one Prometheus-compatible tools use), not only our metric-name scanner."""
    exprs = [*dashboard_exprs(), *(rule["expr"] for rule in alert_rules())]
    bad = []
    for expr in exprs:
        try:
            promql_parser.parse(_as_prometheus_sees_it(expr))
        except ValueError as exc:
            bad.append(f"{expr!r}: {exc}")
    assert bad == []
    with pytest.raises(ValueError, match="parenthesis"):
        promql_parser.parse("sum by (job (rate(aiq_decisions_total[5m]))")


# -- the dashboard ----------------------------------------------------------------------------


def test_dashboard_uses_only_exported_metrics() -> None:
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    assert unknown(exprs, exported()) == []


def test_dashboard_covers_the_metric_groups() -> None:
    used = {sel.metric for expr in dashboard_exprs() for sel in selectors(expr)}
    for name in (
        "aiq_decisions_total",
        "aiq_limit_decisions_total",
        "aiq_tokens_charged_total",
        "aiq_model_tokens_total",
        "aiq_admission_seconds_bucket",
        "aiq_tokenize_seconds_bucket",
        "aiq_redis_call_seconds_bucket",
        "aiq_redis_pool_in_use",
        "aiq_breaker_state",
        "aiq_stream_cuts_total",
        "aiq_request_endings_total",
        "aiq_settlement_backlog",
        "aiq_settlements_total",
        "aiq_usage_disagreements_total",
        "aiq_config_version_info",
        "aiq_usage_record_backlog",
        "aiq_redis_reachable",
        "aiq_config_reload_failed",
    ):
        assert name in used, name


def test_dashboard_panels_are_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]


# -- the alert rules --------------------------------------------------------------------------


def test_alert_rules_are_well_formed() -> None:
    rules = alert_rules()
    assert len(rules) >= 7
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    duration = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
    for rule in rules:
        assert {"alert", "expr", "for", "labels", "annotations"} <= set(rule), rule.get("alert")
        assert duration.match(str(rule["for"])), rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert selectors(rule["expr"]), f"{rule['alert']} uses no aiq_ metric"


def test_alert_rules_use_only_exported_metrics() -> None:
    assert unknown([r["expr"] for r in alert_rules()], exported()) == []


def test_alerts_cover_the_failure_modes() -> None:
    used = {sel.metric for r in alert_rules() for sel in selectors(r["expr"])}
    for name in (
        "aiq_redis_call_seconds_count",
        "aiq_limiter_errors_total",
        "aiq_breaker_state",
        "aiq_config_version_info",
        "aiq_decisions_total",
        "aiq_settlement_backlog",
        "aiq_usage_record_backlog",
        "aiq_tokenizer_load_failures_total",
        "aiq_redis_reachable",
        "aiq_config_reload_failed",
        "aiq_redis_failovers_total",
        "aiq_journal_dropped",
    ):
        assert name in used, name
