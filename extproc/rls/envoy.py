"""An Envoy bootstrap with the global ``envoy.filters.http.ratelimit`` filter calling ai-quota's
RLS API, in front of a plain (non-LLM) route: what the seed article's Envoys run, for tests,
the benchmark and docs/rls.md.

The route's ``rate_limits`` build the seed's descriptor from request headers:
``tenant`` <- ``x-tenant``, ``model`` <- ``x-model``, and ``metric`` = ``rpm`` (a generic key),
so each request counts one hit in the tenant's and model's RPM window.  The route goes to a
plain HTTP upstream; ``baseline_port`` adds the same listener without the
filter (the benchmark's reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from extproc.envoy_config import GrpcClientAuth, secure_cluster, secure_grpc_service


@dataclass(frozen=True)
class RlsEnvoy:
    """Where one Envoy listens and which RLS it calls."""

    listen_port: int
    admin_port: int
    rls_port: int
    upstream_port: int  # any plain HTTP/1.1 server (the tests use the simulator's /healthz)
    domain: str = "ai-gateway"
    failure_mode_deny: bool = False
    timeout_ms: int = 500
    baseline_port: int = 0
    # Envoy's own X-RateLimit-* headers (draft 03) from the statuses, beside any headers
    # the service adds (AIQ_RLS_RESPONSE_HEADERS)
    x_ratelimit_headers: bool = True
    # How Envoy authenticates to the RLS port (token, TLS, client certificate: docs/security.md)
    auth: GrpcClientAuth | None = None


def _route() -> dict[str, Any]:
    # a route to a cluster: the ratelimit filter reads the route entry's policy (a
    # direct_response route has none, so it would never call the service)
    return {"match": {"prefix": "/"}, "route": {"cluster": "plain_upstream"}}


def _hcm(name: str, *, rls: RlsEnvoy | None) -> dict[str, Any]:
    filters: list[dict[str, Any]] = []
    vhost: dict[str, Any] = {"name": "plain", "domains": ["*"], "routes": [_route()]}
    if rls is not None:
        cfg: dict[str, Any] = {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
            "domain": rls.domain,
            "failure_mode_deny": rls.failure_mode_deny,
            "timeout": f"{rls.timeout_ms / 1000:.3f}s",
            "rate_limit_service": {
                "grpc_service": secure_grpc_service(
                    {"envoy_grpc": {"cluster_name": "ai_quota_rls"}}, rls.auth
                ),
                "transport_api_version": "V3",
            },
        }
        if rls.x_ratelimit_headers:
            cfg["enable_x_ratelimit_headers"] = "DRAFT_VERSION_03"
        filters.append({"name": "envoy.filters.http.ratelimit", "typed_config": cfg})
        vhost["routes"][0]["route"]["rate_limits"] = [
            {
                "actions": [
                    {"request_headers": {"header_name": "x-tenant", "descriptor_key": "tenant"}},
                    {"request_headers": {"header_name": "x-model", "descriptor_key": "model"}},
                    {"generic_key": {"descriptor_key": "metric", "descriptor_value": "rpm"}},
                ]
            }
        ]
    filters.append(
        {
            "name": "envoy.filters.http.router",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
            },
        }
    )
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network."
            "http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": name,
            "route_config": {"name": name, "virtual_hosts": [vhost]},
            "http_filters": filters,
        },
    }


def _listener(name: str, port: int, rls: RlsEnvoy | None) -> dict[str, Any]:
    return {
        "name": name,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [_hcm(name, rls=rls)]}],
    }


def bootstrap(e: RlsEnvoy) -> dict[str, Any]:
    """The bootstrap as a dict."""
    listeners = [_listener("limited", e.listen_port, e)]
    if e.baseline_port:
        listeners.append(_listener("baseline", e.baseline_port, None))
    return {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": e.admin_port}}
        },
        "static_resources": {
            "listeners": listeners,
            "clusters": [
                _cluster("plain_upstream", e.upstream_port, http2=False),
                secure_cluster(_cluster("ai_quota_rls", e.rls_port, http2=True), e.auth),
            ],
        },
    }


def _cluster(name: str, port: int, *, http2: bool) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "0.25s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {"address": "127.0.0.1", "port_value": port}
                                }
                            }
                        }
                    ]
                }
            ],
        },
    }
    if http2:
        c["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                "HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return c


def render(e: RlsEnvoy) -> str:
    """The bootstrap as YAML."""
    return yaml.safe_dump(bootstrap(e), sort_keys=False)
