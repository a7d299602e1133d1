"""Claims the docs make about the code, checked against the code (issue 23, defect 8; issue 33):
the figures the docs state for the code's defaults and constants (each parsed next to the
setting it names and compared with the Python value, so a changed default fails here until the
doc says the new figure), the tolerances and delays stated in prose, the README's account of how
input is counted, errors rendered in exactly one module, and what docs/rls.md says of an
unknown domain."""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from extproc.background import INPUT_STOPS_REFRESH_S
from extproc.bench.vllm import RUN_AHEAD_BOUND
from extproc.config.schema import (
    ConfigFile,
    FailurePolicy,
    ModelEntry,
    RequestsPolicy,
    TokenizerModel,
)
from extproc.core.audits import MAX_STOPPED_MODELS
from extproc.core.bound_count import NOTE_AFTER_S
from extproc.core.figures import (
    ABANDONED_TOKENS_PER_SECOND,
    INPUT_SLACK_TOKENS,
    INPUT_TEMPLATE_ALLOWANCE,
    INPUT_TOLERANCE,
    OUTPUT_SLACK_TOKENS,
    OUTPUT_TOLERANCE,
)
from extproc.core.tokens import TokenizerSpec
from extproc.limiter.base import MAX_RIDERS
from extproc.limiter.batch import DEFAULT_MAX_BATCH
from extproc.settings import Settings

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def text(path: str) -> str:
    """A doc's text with its line breaks folded to spaces."""
    return " ".join((REPO / path).read_text("utf-8").split())


def default(model: type[BaseModel], field: str) -> Any:
    """A pydantic model's default for ``field`` (a rules-file or process setting)."""
    return model.model_fields[field].default


#: (doc, the name as the doc writes it in backticks, the code's value): every figure the doc
#: states right after the name, ``(N unit)``, ``(default N unit)`` or ``, N unit``, must be the
#: code's value, and the doc must state it at least once.
STATED: list[tuple[str, str, float]] = [
    (
        "docs/semantics.md",
        "failure.reservation_lease_seconds",
        default(FailurePolicy, "reservation_lease_seconds"),
    ),
    ("docs/semantics.md", "failure.timeout_ms", default(FailurePolicy, "timeout_ms")),
    ("docs/operations.md", "failure.timeout_ms", default(FailurePolicy, "timeout_ms")),
    ("docs/rls.md", "failure.timeout_ms", default(FailurePolicy, "timeout_ms")),
    ("docs/operations.md", "breaker_cooldown_ms", default(FailurePolicy, "breaker_cooldown_ms")),
    ("docs/operations.md", "ledger_ttl_seconds", default(ConfigFile, "ledger_ttl_seconds")),
    (
        "docs/semantics.md",
        "abandoned_tokens_per_second",
        default(ModelEntry, "abandoned_tokens_per_second"),
    ),
    (
        "docs/semantics.md",
        "requests.input_audit_every",
        default(RequestsPolicy, "input_audit_every"),
    ),
    ("docs/semantics.md", "requests.bound_headroom", default(RequestsPolicy, "bound_headroom")),
    ("docs/semantics.md", "requests.bound_below", default(RequestsPolicy, "bound_below")),
    (
        "docs/semantics.md",
        "requests.count_deadline_ms",
        default(RequestsPolicy, "count_deadline_ms"),
    ),
    ("docs/envoy.md", "requests.max_body_bytes", default(RequestsPolicy, "max_body_bytes")),
    ("docs/semantics.md", "INPUT_STOPS_REFRESH_S", INPUT_STOPS_REFRESH_S),
    ("docs/semantics.md", "AIQ_ALLOWANCE_SHARE", default(Settings, "allowance_share")),
    ("docs/semantics.md", "AIQ_ALLOWANCE_TTL_MS", default(Settings, "allowance_ttl_ms")),
    ("docs/semantics.md", "AIQ_ALLOWANCE_MIN_RATE", default(Settings, "allowance_min_rate")),
    ("docs/performance.md", "AIQ_ALLOWANCE_MIN_RATE", default(Settings, "allowance_min_rate")),
    (
        "docs/semantics.md",
        "AIQ_ALLOWANCE_MAX_WINDOW_S",
        default(Settings, "allowance_max_window_s"),
    ),
    ("docs/rls.md", "AIQ_RLS_NEAR_LIMIT_RATIO", default(Settings, "rls_near_limit_ratio")),
    (
        "docs/rls.md",
        "AIQ_RLS_DETAILED_METRIC_SERIES",
        default(Settings, "rls_detailed_metric_series"),
    ),
    (
        "docs/observability.md",
        "AIQ_RLS_DETAILED_METRIC_SERIES",
        default(Settings, "rls_detailed_metric_series"),
    ),
    ("docs/tokenizers.md", "chars_per_token", default(TokenizerModel, "chars_per_token")),
    ("docs/tokenizers.md", "safety_factor", default(TokenizerModel, "safety_factor")),
    ("docs/tokenizers.md", "tokens_per_message", default(TokenizerModel, "tokens_per_message")),
    ("docs/tokenizers.md", "tokens_per_name", default(TokenizerModel, "tokens_per_name")),
    ("docs/tokenizers.md", "reply_priming_tokens", default(TokenizerModel, "reply_priming_tokens")),
    ("docs/tokenizers.md", "image_tokens", default(TokenizerModel, "image_tokens")),
    ("docs/tokenizers.md", "audio_tokens", TokenizerSpec.audio_tokens),
    ("docs/tokenizers.md", "file_tokens", TokenizerSpec.file_tokens),
    ("docs/performance.md", "MAX_RIDERS", MAX_RIDERS),
    ("docs/performance.md", "max_batch", DEFAULT_MAX_BATCH),
    ("docs/bench/JOURNAL.md", "MAX_RIDERS", MAX_RIDERS),
    ("docs/bench/JOURNAL.md", "max_batch", DEFAULT_MAX_BATCH),
    ("docs/engine-tests.md", "RUN_AHEAD_BOUND", RUN_AHEAD_BOUND),
]

_NUMBER = r"([0-9][0-9,]*(?:\.[0-9]+)?)\s*(ms|s|MiB|KiB)?\b"
_SCALE = {"MiB": 1 << 20, "KiB": 1 << 10}


def stated(doc: str, name: str) -> list[float]:
    """The figures ``doc`` states for ``name`` (:func:`figures_in` its text)."""
    return figures_in(text(doc), name)


def figures_in(prose: str, name: str) -> list[float]:
    """The figures ``prose`` states right after `` `name` ``, in the unit of the code's value:
    a name ending in ``_ms`` given in seconds is scaled to milliseconds, one ending in
    ``_seconds`` or ``_S`` given in milliseconds to seconds, bytes in MiB/KiB to bytes."""
    pattern = re.compile(r"`" + re.escape(name) + r"`\s*(?:\(\s*(?:default\s+)?|,\s+)" + _NUMBER)
    out = []
    for number, unit in pattern.findall(prose):
        value = float(number.replace(",", ""))
        if unit == "s" and name.lower().endswith("_ms"):
            value *= 1000
        elif unit == "ms" and name.lower().endswith(("_seconds", "_s")):
            value /= 1000
        value *= _SCALE.get(unit, 1)
        out.append(value)
    return out


@pytest.mark.parametrize(("doc", "name", "value"), STATED, ids=[f"{d}:{n}" for d, n, _ in STATED])
def test_the_figures_the_docs_state_are_the_codes(doc: str, name: str, value: float) -> None:
    """Every figure a doc gives next to a setting or constant is the code's default."""
    figures = stated(doc, name)
    assert figures, f"{doc} no longer states `{name}`'s figure (the code's is {value})"
    wrong = [f for f in figures if not math.isclose(f, float(value))]
    assert not wrong, f"{doc} says `{name}` is {wrong}; the code says {value}"


def test_the_parser_reads_units_and_refuses_a_stale_figure() -> None:
    """The check above can fail: units are converted, and a figure other than the code's is
    found (the way semantics.md's stale abandon rate once survived a phrase match)."""
    assert stated("docs/operations.md", "breaker_cooldown_ms") == [1000.0]  # "(1 s)"
    assert stated("docs/envoy.md", "requests.max_body_bytes") == [1048576.0]  # "(1 MiB)"
    assert stated("docs/semantics.md", "failure.reservation_lease_seconds")  # ", 15 s"
    stale = figures_in(
        "billed at `abandoned_tokens_per_second` (default 400) per", "abandoned_tokens_per_second"
    )
    assert stale == [400.0] and not math.isclose(stale[0], ABANDONED_TOKENS_PER_SECOND)
    assert figures_in("`x` (a quarter)", "x") == [] and figures_in("`t_ms`, 3 s", "t_ms") == [
        3000.0
    ]


def test_the_abandon_rate_default_is_one_figure() -> None:
    """The rules-file default and the core's constant are the same number (the doc is checked
    against the former)."""
    assert default(ModelEntry, "abandoned_tokens_per_second") == ABANDONED_TOKENS_PER_SECOND


def test_the_prose_figures_are_the_codes() -> None:
    """Figures stated in sentences rather than next to a name: the counted path's input bounds
    ``[0.75 x count - 16, 1.25 x count + 64]``, the delay after which an open request admitted
    on a bound is counted for its ledger, the cap of the stopped-models table."""
    sem = text("docs/semantics.md")
    times, minus = "\u00d7", "\u2212"  # as the doc writes them
    bounds = re.findall(
        rf"\[([0-9.]+) {times} count {minus} (\d+), ([0-9.]+) {times} count \+ (\d+)\]", sem
    )
    assert bounds, "semantics.md no longer states the counted path's input bounds"
    for low, slack, high, allowance in bounds:
        assert math.isclose(float(low), 1 - INPUT_TOLERANCE)
        assert math.isclose(float(high), 1 + INPUT_TOLERANCE)
        assert (int(slack), int(allowance)) == (INPUT_SLACK_TOKENS, INPUT_TEMPLATE_ALLOWANCE)
    for doc in ("docs/semantics.md", "docs/performance.md"):
        delays = re.findall(r"still open ([0-9.]+) s after", text(doc))
        assert delays, f"{doc} no longer states when an open request is counted"
        assert {float(d) for d in delays} == {NOTE_AFTER_S}, doc
    caps = re.findall(r"past ([0-9,]+) stopped models", sem)
    assert caps and {int(c.replace(",", "")) for c in caps} == {MAX_STOPPED_MODELS}


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
