"""Claims the docs make about the code, checked against the code (issue 23, defect 8): the
output tolerance semantics.md states, the README's account of how input is counted, errors
rendered in exactly one module, and what docs/rls.md says of an unknown domain."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from extproc.config.schema import RequestsPolicy
from extproc.core.figures import OUTPUT_SLACK_TOKENS, OUTPUT_TOLERANCE

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def text(path: str) -> str:
    """A doc's text with its line breaks folded to spaces."""
    return " ".join((REPO / path).read_text("utf-8").split())


def test_semantics_states_the_output_tolerance_the_code_uses() -> None:
    """semantics.md's "Usage claims" gives the tolerance and slack of ``bounded_output``."""
    found = re.findall(r"counted minus (\d+) % and (\d+) tokens", text("docs/semantics.md"))
    assert found, "semantics.md no longer states the output tolerance"
    assert {(int(p), int(n)) for p, n in found} == {
        (round(OUTPUT_TOLERANCE * 100), OUTPUT_SLACK_TOKENS)
    }


def test_the_readme_says_how_admission_counts_by_default() -> None:
    """The README's first account of admission states the default the code has: counted
    before admission unless ``admit_on_bound`` (off by default) admits on a bound."""
    readme = text("README.md")
    first = readme[readme.index("1. **Admits**") : readme.index("2. **Watches")]
    assert "admit_on_bound" in first and "upper bound" in first
    assert RequestsPolicy().admit_on_bound is False
    assert "counted with the model's real tokenizer before admission" in first


def test_errors_are_rendered_in_one_module() -> None:
    """No codec or server module builds an error object itself: every error body and cut
    event comes from ``extproc/core/apis/errors.py``."""
    offenders: list[str] = []
    for path in [
        *(REPO / "extproc/core/apis").rglob("*.py"),
        *(REPO / "extproc/server").glob("*.py"),
    ]:
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Dict) and any(
                isinstance(k, ast.Constant) and k.value == "error" for k in node.keys
            ):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} an error object")
            if isinstance(node, ast.Name | ast.Attribute) and (
                getattr(node, "id", None) == "ErrorBody"
                or getattr(node, "attr", None) == "ErrorBody"
            ):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} ErrorBody")
    assert not offenders, offenders


def test_rls_doc_says_an_unknown_domain_counts_nothing() -> None:
    """docs/rls.md: an unknown domain is answered OK and nothing is counted; limit overrides
    only where a domain allows them."""
    rls = text("docs/rls.md")
    assert "Unknown domain or no matching rule: OK without a limit" not in rls
    assert (
        "is answered OK without a limit whatever its descriptors carry, limit overrides "
        "included: nothing is counted"
    ) in rls
    assert "applies only in a domain that allows it" in rls
    assert "allow_limit_override" in rls
