"""Unit tests for how a rules file's errors are reported: ``file:line:col: path: message``."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.app import load_rules
from extproc.cli import main
from extproc.config import ConfigError, load_config, load_config_text
from extproc.config.source import parse_rules, render_path

pytestmark = pytest.mark.unit

VALID = """\
version: 1
models:
  m:
    tokenizer: {kind: estimate}
    max_output_tokens: 100
plans:
  basic:
    limits:
      - {model: "*", rpm: 60}
tenants:
  acme:
    plan: basic
    keys:
      - {name: a, plaintext: sk-a}
"""


def error_of(text: str, source: str = "rules.yaml") -> str:
    with pytest.raises(ConfigError) as info:
        load_config_text(text, source=source)
    return str(info.value)


def test_the_valid_document_loads() -> None:
    """The base of the cases below is itself valid."""
    assert "acme" in load_config_text(VALID, source="rules.yaml").tenants


def test_syntax_error_names_file_line_and_column(tmp_path: Path) -> None:
    """A YAML syntax error is ``file:line:col``, not PyYAML's ``<unicode string>``."""
    bad = tmp_path / "rules.yaml"
    bad.write_text("version: 1\nmodels:\n  a: [\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    msg = str(info.value)
    assert msg.startswith(f"{bad}:4:1: not valid YAML: ")
    assert "<unicode string>" not in msg


def test_check_config_prints_the_location(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ai-quota check-config`` exits 1 and prints the file:line:col message on stderr."""
    bad = tmp_path / "rules.yaml"
    bad.write_text("version: 1\nmodels:\n  a: [\n")
    assert main(["check-config", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{bad}:4:1: not valid YAML")


def test_duplicate_key_refused_with_location_and_path() -> None:
    """A repeated key is an error naming where it repeats, its mapping and the first one."""
    text = VALID.replace("    plan: basic\n", "    plan: basic\n    plan: gold\n")
    assert (
        error_of(text) == "rules.yaml:13:5: tenants.acme: duplicate key 'plan' (first at line 12)"
    )


def test_duplicate_top_level_key_refused() -> None:
    """The top level is checked too (PyYAML alone keeps the last value silently)."""
    assert error_of("version: 1\nversion: 1\n") == (
        "rules.yaml:2:1: (top level): duplicate key 'version' (first at line 1)"
    )


def test_duplicate_key_inside_a_list_item_names_the_index() -> None:
    """Inside a list the path renders the index as ``[i]``."""
    text = VALID.replace("{name: a, plaintext: sk-a}", "{name: a, name: b, plaintext: sk-a}")
    assert error_of(text) == (
        "rules.yaml:14:19: tenants.acme.keys[0]: duplicate key 'name' (first at line 14)"
    )


def test_same_key_in_different_mappings_is_fine() -> None:
    """Only a key repeated in one mapping is refused; merge keys may be overridden."""
    text = "base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  x: 3\nthird: {x: 1}\n"
    assert parse_rules(text, "r.yaml").data["other"] == {"x": 3, "y": 2}


def test_serve_and_reload_use_the_same_loader(tmp_path: Path) -> None:
    """``serve`` and a SIGHUP reload load rules through ``load_rules``: duplicates refused."""
    f = tmp_path / "rules.yaml"
    f.write_text(VALID.replace("version: 1\n", "version: 1\nversion: 1\n"))
    with pytest.raises(ConfigError, match=r"rules\.yaml:2:1: .*duplicate key 'version'"):
        load_rules(str(f))


def test_list_index_paths_render_in_brackets() -> None:
    """Validation errors inside lists read ``keys[0].sha256``, with the node's line."""
    text = VALID.replace("{name: a, plaintext: sk-a}", "{name: a, sha256: xyz}")
    msg = error_of(text)
    assert msg.startswith("rules.yaml:14:19: tenants.acme.keys[0].sha256: ")
    assert "keys.0" not in msg


def test_unknown_key_and_missing_field_have_lines() -> None:
    """An unknown key points at itself; a missing field at the mapping it is missing from."""
    text = VALID.replace("    max_output_tokens: 100\n", "    colour: blue\n")
    lines = error_of(text).splitlines()
    assert "rules.yaml:3:3: models.m.max_output_tokens: Field required" in lines
    assert "rules.yaml:5:5: models.m.colour: unknown key" in lines


def test_missing_top_level_section_has_no_line() -> None:
    """A missing top-level section has nowhere to point: just the file."""
    text = VALID.split("tenants:", maxsplit=1)[0]
    assert "rules.yaml: tenants: Field required" in error_of(text).splitlines()


def test_errors_found_after_validation_get_lines_too() -> None:
    """Reference errors (unknown plan, unknown model) carry the line of their node."""
    text = VALID.replace("plan: basic", "plan: gold").replace('model: "*"', "model: nope")
    lines = error_of(text).splitlines()
    assert "rules.yaml:9:10: plans.basic.limits[0].model: unknown model 'nope'" in lines
    assert "rules.yaml:12:5: tenants.acme.plan: unknown plan 'gold'" in lines


@pytest.mark.parametrize(
    ("parts", "text"),
    [
        (("tenants", "acme", "keys", 0, "sha256"), "tenants.acme.keys[0].sha256"),
        (("plans", "p", "limits", 2), "plans.p.limits[2]"),
        ((0, "a"), "[0].a"),
        ((), ""),
    ],
)
def test_render_path(parts: tuple[str | int, ...], text: str) -> None:
    """Mapping keys are joined with dots, list indexes are ``[i]``."""
    assert render_path(parts) == text
