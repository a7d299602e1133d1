"""The envoyproxy/ratelimit config format: what loads, and errors naming file, line and path."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.rls.config import BucketLink, RlsConfigError
from extproc.rls.load import load_path, looks_like_rls
from extproc.rls.parse import parse_text

pytestmark = pytest.mark.unit

SEED = """\
domain: ai-gateway

descriptors:
  - key: tenant
    descriptors:
      - key: model
        descriptors:
          - key: metric
            value: rpm
            rate_limit:
              unit: minute
              requests_per_unit: 60

          - key: metric
            value: tpm
            rate_limit:
              unit: minute
              requests_per_unit: 100000
"""


def errors_of(text: str, name: str = "f.yaml") -> list[str]:
    """The errors a text raises (fails the test when it loads)."""
    with pytest.raises(RlsConfigError) as info:
        parse_text(text, name)
    return info.value.errors


def test_seed_config_loads() -> None:
    """The seed article's config loads into tenant -> model -> metric with two rules."""
    d = parse_text(SEED, "seed.yaml")
    assert d.name == "ai-gateway"
    tenant = d.root.children[("tenant", "")]
    model = tenant.children[("model", "")]
    rpm = model.children[("metric", "rpm")].rule
    tpm = model.children[("metric", "tpm")].rule
    assert rpm is not None and (rpm.unit, rpm.requests_per_unit) == ("minute", 60)
    assert tpm is not None and tpm.requests_per_unit == 100_000
    assert rpm.path == "ai-gateway.tenant.model.metric_rpm"


def test_every_flag_and_extension_loads() -> None:
    """replaces, name, unlimited, shadow_mode, detailed_metric, wildcards, ai_quota parse."""
    d = parse_text(
        """
domain: d
descriptors:
  - key: k
    value: "a*"
    shadow_mode: true
    detailed_metric: true
    rate_limit: {unit: Second, requests_per_unit: 5, name: wide}
  - key: u
    rate_limit: {unlimited: true}
  - key: tenant
    descriptors:
      - key: metric
        value: tpm
        ai_quota: {bucket: tpm, tenant: tenant}
        rate_limit: {unit: minute, requests_per_unit: 100, replaces: [{name: wide}]}
""",
        "x.yaml",
    )
    wk, parts, node = d.root.wildcards[0]
    assert (wk, parts) == ("k", ("a", ""))
    assert node.rule is not None and node.rule.shadow_mode and node.rule.detailed_metric
    assert node.rule.unit == "second" and node.rule.name == "wide"
    unl = d.root.children[("u", "")].rule
    assert unl is not None and unl.unlimited and unl.unit == ""
    tpm = d.root.children[("tenant", "")].children[("metric", "tpm")].rule
    assert tpm is not None and tpm.replaces == ("wide",)
    assert tpm.link == BucketLink("tpm", "tenant", "*")


def test_unit_multiplier_and_allow_limit_override_load() -> None:
    """``unit_multiplier`` (default 1) scales the window; ``allow_limit_override`` defaults to
    false."""
    text = (
        "domain: d\ndescriptors:\n  - key: a\n"
        "    rate_limit: {unit: second, unit_multiplier: 30, requests_per_unit: 3}\n"
        "  - key: b\n    rate_limit: {unit: hour, requests_per_unit: 3}\n"
    )
    d = parse_text(text, "m.yaml")
    a, b = d.root.children[("a", "")].rule, d.root.children[("b", "")].rule
    assert a is not None and (a.unit, a.unit_multiplier, a.window_s) == ("second", 30, 30)
    assert b is not None and (b.unit_multiplier, b.window_s) == (1, 3600)
    assert not d.allow_override
    assert parse_text("allow_limit_override: true\n" + text, "m.yaml").allow_override


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "domain: d\ndescriptors:\n  - key: a\n    vaule: x\n",
            "f.yaml:4: descriptors[0].vaule: unknown key 'vaule'",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    value: x\n  - key: a\n    value: x\n",
            "f.yaml:5: descriptors[1]: duplicate descriptor 'd.a_x'",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n",
            "f.yaml:5: descriptors[0].rate_limit.unit: invalid unit 'fortnight'",
        ),
        (
            "domain: d\ndescriptors:\n  - key: 'a*'\n",
            "f.yaml:3: descriptors[0].key: a wildcard '*'",
        ),
        ("domain: ''\n", "the domain must not be empty"),
        ("descriptors: []\n", "missing key 'domain'"),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true, unit: minute}\n",
            "an unlimited rate_limit takes no unit",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: -1}\n",
            "must be between 0 and 4294967295",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 1, name: n, replaces: [{name: n}]}\n",
            "a rule cannot replace itself",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 1, replaces: [{}]}\n",
            "a replaces entry needs a non-empty name",
        ),
        ("domain: d\ndomain: e\n", "f.yaml:2: domain: duplicate key"),
        ("domain: d\ndescriptors: {key: a}\n", "descriptors: expected a list, found a mapping"),
        (
            "domain: d\ndescriptors:\n  - key: a\n    shadow_mode: yes please\n",
            "expected true or false",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    value: x\n    share_threshold: true\n",
            "share_threshold needs a wildcard",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    ai_quota: {bucket: tpm, tenant: t}\n    rate_limit: {unit: minute, requests_per_unit: 1}\n",
            "'t' is not a key on this descriptor's path (a)",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    ai_quota: {bucket: tpm, tenant: a}\n    rate_limit: {unit: month, requests_per_unit: 1}\n",
            "this rule's unit is 'month'",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    ai_quota: {bucket: cost, tenant: a}\n    rate_limit: {unit: minute, requests_per_unit: 1}\n",
            "bucket must be rpm or tpm",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {requests_per_unit: 1}\n",
            "missing key 'unit'",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, unit_multiplier: 0, requests_per_unit: 1}\n",
            "f.yaml:4: descriptors[0].rate_limit.unit_multiplier: must be at least 1",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: year, unit_multiplier: 11, requests_per_unit: 1}\n",
            "11 years is longer than the longest window (3650 days)",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true, unit_multiplier: 2}\n",
            "an unlimited rate_limit takes no unit_multiplier",
        ),
        (
            "domain: d\ndescriptors:\n  - key: a\n    ai_quota: {bucket: tpm, tenant: a}\n    rate_limit: {unit: minute, unit_multiplier: 5, requests_per_unit: 1}\n",
            "an ai-quota bucket counts in windows of one unit; this rule has unit_multiplier 5",
        ),
        (
            "domain: d\nallow_limit_override: sometimes\n",
            "f.yaml:2: allow_limit_override: expected true or false",
        ),
        ("domain: [d\n", "f.yaml:2: not valid YAML"),
        ("", "the file is empty"),
    ],
)
def test_errors_name_file_line_and_path(text: str, expected: str) -> None:
    """Each mistake is reported with its file, line and path."""
    errs = errors_of(text)
    assert any(expected in e for e in errs), errs


def test_all_errors_of_a_file_at_once() -> None:
    """Two mistakes in one file are both reported."""
    errs = errors_of("domain: d\ndescriptors:\n  - key: a\n    bad: 1\n  - kee: b\n")
    assert len(errs) == 3, errs  # bad, kee, missing key


def test_directory_one_file_per_domain(tmp_path: Path) -> None:
    """A directory loads every YAML file, skips dot files, and a domain twice is an error."""
    (tmp_path / "a.yaml").write_text(SEED)
    (tmp_path / "b.yml").write_text("domain: other\ndescriptors: []\n")
    (tmp_path / ".a.yaml.swp").write_text("garbage: [")
    (tmp_path / "notes.txt").write_text("not config")
    cfg = load_path(tmp_path)
    assert sorted(cfg.domains) == ["ai-gateway", "other"]
    assert cfg.rules == 2
    assert looks_like_rls(tmp_path)
    (tmp_path / "c.yaml").write_text(SEED)
    with pytest.raises(RlsConfigError) as info:
        load_path(tmp_path)
    assert "duplicate domain 'ai-gateway' (also in" in str(info.value)
    assert str(tmp_path / "c.yaml") in str(info.value)


def test_errors_across_files_together(tmp_path: Path) -> None:
    """Errors in two files are reported together, each naming its file."""
    (tmp_path / "a.yaml").write_text("domain: a\ndescriptors:\n  - key: x\n    typo: 1\n")
    (tmp_path / "b.yaml").write_text("domain: b\ndescriptors:\n  - key: y\n    typo: 1\n")
    with pytest.raises(RlsConfigError) as info:
        load_path(tmp_path)
    assert [e.split(":")[0] for e in info.value.errors] == [
        str(tmp_path / "a.yaml"),
        str(tmp_path / "b.yaml"),
    ]


def test_rules_file_is_not_rls(tmp_path: Path) -> None:
    """An ai-quota rules file (no domain key) is not taken for an RLS config."""
    p = tmp_path / "rules.yaml"
    p.write_text("version: 1\ntenants: {}\n")
    assert not looks_like_rls(p)
    assert not looks_like_rls(tmp_path / "missing.yaml")


def test_shipped_demo_config_loads() -> None:
    """config/ratelimit/ loads: the seed's domain, its TPM rule counting in the tenant's bucket."""
    root = Path(__file__).resolve().parents[2] / "config" / "ratelimit"
    cfg = load_path(root)
    d = cfg.domains["ai-gateway"]
    model = d.root.children[("tenant", "")].children[("model", "")]
    tpm = model.children[("metric", "tpm")].rule
    assert tpm is not None and tpm.link == BucketLink("tpm", "tenant", "model", 0, 1)
    assert tpm.requests_per_unit == 100_000


def test_check_config_cli_on_rls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`ai-quota check-config` takes an RLS directory or file: 0 and a summary, or 1 and
    every error with file and line."""
    from extproc.cli import main

    root = Path(__file__).resolve().parents[2] / "config" / "ratelimit"
    assert main(["check-config", str(root)]) == 0
    out = capsys.readouterr().out
    assert "OK (RLS config: 1 domain(s) ai-gateway; 2 rate limit(s)" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: often}\n")
    assert main(["check-config", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:4: descriptors[0].rate_limit.unit: invalid unit 'often'" in err


def test_scalar_values_are_their_text() -> None:
    """`value: 200` and `value: true` match the descriptor values "200" and "true"."""
    d = parse_text(
        "domain: d\ndescriptors:\n  - key: code\n    value: 200\n  - key: b\n    value: true\n",
        "v.yaml",
    )
    assert ("code", "200") in d.root.children and ("b", "true") in d.root.children
