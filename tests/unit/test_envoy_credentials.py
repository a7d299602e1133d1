"""How ``ai-quota envoy-config`` renders Envoy's credentials for the processors' closed port:
the token as the ext_proc ``grpc_service``'s ``initial_metadata``, the cluster's
``UpstreamTlsContext`` (server check, client certificate), and the flags' consistency checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from extproc.cli import build_parser
from extproc.commands.envoy_config import auth_from
from extproc.envoy_config import EnvoyPorts, GrpcClientAuth, render
from extproc.rls.envoy import RlsEnvoy
from extproc.rls.envoy import render as render_rls

pytestmark = pytest.mark.unit


def _ext_proc(boot: dict[str, Any]) -> dict[str, Any]:
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = hcm["typed_config"]["http_filters"]
    return next(f for f in filters if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]  # type: ignore[no-any-return]


def _cluster(boot: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in boot["static_resources"]["clusters"] if c["name"] == name)


def test_without_credentials_nothing_is_added() -> None:
    """The default bootstrap (a processor served --insecure) has no TLS and no metadata."""
    boot = render(EnvoyPorts())
    assert "initial_metadata" not in _ext_proc(boot)["grpc_service"]
    assert "transport_socket" not in _cluster(boot, "extproc")


def test_token_and_mutual_tls_are_rendered() -> None:
    """The token goes in initial_metadata; TLS checks the CA and the SAN, with Envoy's cert."""
    auth = GrpcClientAuth(
        token="t0k", ca_file="/c/ca.pem", cert_file="/c/envoy.pem", key_file="/c/envoy.key"
    )
    boot = render(EnvoyPorts(extproc_auth=auth))
    assert _ext_proc(boot)["grpc_service"]["initial_metadata"] == [
        {"key": "authorization", "value": "Bearer t0k"}
    ]
    tls = _cluster(boot, "extproc")["transport_socket"]["typed_config"]
    assert tls["sni"] == "ai-quota"
    common = tls["common_tls_context"]
    assert common["alpn_protocols"] == ["h2"]
    assert common["validation_context"]["trusted_ca"] == {"filename": "/c/ca.pem"}
    assert common["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "ai-quota"}}
    ]
    assert common["tls_certificates"][0]["private_key"] == {"filename": "/c/envoy.key"}


def test_the_rls_envoy_carries_the_same_credentials() -> None:
    """The ratelimit filter's grpc_service and cluster get the token and the TLS context."""
    import yaml

    auth = GrpcClientAuth(token="t0k", ca_file="/c/ca.pem")
    boot = yaml.safe_load(render_rls(RlsEnvoy(1, 2, 3, 4, auth=auth)))
    assert "Bearer t0k" in str(boot) and "UpstreamTlsContext" in str(boot)
    assert "transport_socket" in _cluster(boot, "ai_quota_rls")


def test_the_flags_are_checked(tmp_path: Path) -> None:
    """A token file's first token is used; a client certificate needs its key and a CA."""
    token = tmp_path / "tokens"
    token.write_text("# new first\nnew-token\nold-token\n")

    def args(*flags: str) -> Any:
        return build_parser().parse_args(["envoy-config", *flags])

    auth = auth_from(args("--extproc-token-file", str(token)))
    assert auth is not None and auth.token == "new-token" and not auth.tls
    assert auth_from(args()) is None
    with pytest.raises(ValueError, match="go together"):
        auth_from(args("--extproc-ca", "ca", "--extproc-client-cert", "c"))
    with pytest.raises(ValueError, match="needs --extproc-ca"):
        auth_from(args("--extproc-client-cert", "c", "--extproc-client-key", "k"))
    token.write_text("\n# nothing\n")
    with pytest.raises(ValueError, match="holds no token"):
        auth_from(args("--extproc-token-file", str(token)))
