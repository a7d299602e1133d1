"""Render the Envoy bootstrap that puts the ext_proc filter in front of an OpenAI-style upstream.

The processing mode follows what was measured on Envoy 1.40 (see docs/envoy.md): request
headers SEND, request body BUFFERED (the listener buffer limit turns bigger bodies into 413),
response headers SEND, response body NONE with ``allow_mode_override`` so SSE responses can
switch to FULL_DUPLEX_STREAMED, ``failure_mode_allow: false``.

Availability of the ext_proc cluster (rolling restarts without failed requests, see
docs/operations.md):

- an active ``grpc.health.v1`` health check every ``health_interval_ms`` (a replica that reports
  NOT_SERVING, i.e. one that is draining, leaves the rotation after one failed check and is back
  after one good one); ``no_traffic_interval`` is as short, so an idle Envoy notices too;
- outlier detection on local-origin failures (connect refused, resets), so a replica that was
  SIGKILLed is ejected before its next health check;
- a retry policy on the filter's ``grpc_service``: an ext_proc stream that could not start (connect
  failure, refused stream, reset or UNAVAILABLE before the processor answered anything) is
  retried on another replica (``previous_hosts`` predicate).  Envoy buffers the stream's messages
  for that (``setBufferBodyForRetry``); once the processor has answered, a failure is not
  retried (the request may already be admitted).

Trusted identity headers (the ``header`` identity source, docs/identity.md): the first HTTP
filter is a ``header_mutation`` that removes ``trusted_headers`` from every client request, so
only a filter placed after it (``identity_filters``: ext_authz, Lua, ...) can set them before
ext_proc reads them.  A route's ``request_headers_to_remove`` would not do: the router applies it
after every filter, ext_proc included, has seen the client's value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from extproc.core.waiting import HOLD_TIMEOUT_MS
from extproc.envoy_tracing import EnvoyTracing, otel_cluster, tracing_config

ACCESS_LOG_FORMAT: dict[str, str] = {
    "time": "%START_TIME%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(:PATH)%",
    "status": "%RESPONSE_CODE%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "flags": "%RESPONSE_FLAGS%",
    "duration_ms": "%DURATION%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "tenant": "%DYNAMIC_METADATA(ai_quota:tenant)%",
    "model": "%DYNAMIC_METADATA(ai_quota:model)%",
    "input_tokens": "%DYNAMIC_METADATA(ai_quota:input_tokens)%",
    "output_tokens": "%DYNAMIC_METADATA(ai_quota:output_tokens)%",
    "ending": "%DYNAMIC_METADATA(ai_quota:ending)%",
}


#: The header identity source's default header names (extproc.config.schema.HeaderIdentity).
DEFAULT_TRUSTED_HEADERS = ("x-authenticated-tenant", "x-authenticated-user")


@dataclass(frozen=True)
class GrpcClientAuth:
    """How Envoy proves itself to the processor's gRPC port (docs/security.md): a bearer token
    sent as the ``grpc_service``'s ``initial_metadata``, and/or TLS (the processor's certificate
    checked against ``ca_file`` and ``server_name``) with a client certificate (mutual TLS)."""

    token: str = ""
    ca_file: str = ""  # TLS to the processor when set
    cert_file: str = ""  # Envoy's client certificate (mutual TLS) ...
    key_file: str = ""  # ... and its key
    server_name: str = "ai-quota"  # SNI, and the DNS SAN the processor's certificate must hold

    @property
    def tls(self) -> bool:
        """Whether Envoy talks TLS to the processor."""
        return bool(self.ca_file)


def secure_grpc_service(service: dict[str, Any], auth: GrpcClientAuth | None) -> dict[str, Any]:
    """``service`` (a ``grpc_service``) with the bearer token as its ``initial_metadata``."""
    if auth is not None and auth.token:
        service["initial_metadata"] = [{"key": "authorization", "value": f"Bearer {auth.token}"}]
    return service


def secure_cluster(cluster: dict[str, Any], auth: GrpcClientAuth | None) -> dict[str, Any]:
    """``cluster`` (the processor's) with an ``UpstreamTlsContext`` when ``auth`` uses TLS."""
    if auth is None or not auth.tls:
        return cluster
    common: dict[str, Any] = {
        "alpn_protocols": ["h2"],
        "validation_context": {
            "trusted_ca": {"filename": auth.ca_file},
            "match_typed_subject_alt_names": [
                {"san_type": "DNS", "matcher": {"exact": auth.server_name}}
            ],
        },
    }
    if auth.cert_file:
        common["tls_certificates"] = [
            {
                "certificate_chain": {"filename": auth.cert_file},
                "private_key": {"filename": auth.key_file},
            }
        ]
    cluster["transport_socket"] = {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": auth.server_name,
            "common_tls_context": common,
        },
    }
    return cluster


@dataclass(frozen=True)
class EnvoyPorts:
    """Where Envoy listens and what it talks to."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 10000
    admin_port: int = 9901
    upstreams: tuple[tuple[str, int], ...] = (("127.0.0.1", 18080),)
    extprocs: tuple[tuple[str, int], ...] = (("127.0.0.1", 50051),)
    max_body_bytes: int = 1_048_576
    # Above the processor's own deadlines, so that a slow answer gets the gateway's JSON 503,
    # never Envoy's empty 504: counting a prompt (requests.count_deadline_ms, 4 s) and an
    # admission that waits out a Redis failover (AIQ_REDIS_FAILOVER_WAIT_S, 8 s, plus the last
    # call's own timeout and the queue for a counting thread).
    message_timeout_ms: int = 12000
    health_interval_ms: int = 500
    with_baseline_listener: int = 0  # a second listener without the filter (benchmarks)
    extra: dict[str, Any] = field(default_factory=dict)
    # Identity from a JWT: Envoy's jwt_authn verifies it against a local JWKS file and puts the
    # payload in metadata, which ext_proc forwards to the processor (docs/identity.md).
    jwt: JwtAuth | None = None
    # Identity headers only a filter of ours may set (identity.header in the rules): removed
    # from every client request before any other filter runs.
    trusted_headers: tuple[str, ...] = DEFAULT_TRUSTED_HEADERS
    # Filters that set them (ext_authz, Lua, ...): placed after the removal, before ext_proc.
    identity_filters: tuple[dict[str, Any], ...] = ()
    # How Envoy authenticates to the processors (token, TLS, client certificate); None: plaintext
    # without credentials (a processor served --insecure).
    extproc_auth: GrpcClientAuth | None = None
    # Envoy's OpenTelemetry tracer, to the collector the processors export to (None: no tracing)
    tracing: EnvoyTracing | None = None


@dataclass(frozen=True)
class JwtAuth:
    """A JWT provider for ``envoy.filters.http.jwt_authn``."""

    issuer: str
    jwks_path: str
    audiences: tuple[str, ...] = ()
    # False: a request without a valid token passes without a payload, so the processor's
    # other identity sources (the gateway's own API keys, sent in the same header) decide.
    required: bool = True


def _endpoints(addrs: tuple[tuple[str, int], ...]) -> list[dict[str, Any]]:
    return [
        {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}}
        for h, p in addrs
    ]


def _cluster_type(addrs: tuple[tuple[str, int], ...]) -> str:
    return "STATIC" if all(h.replace(".", "").isdigit() for h, _ in addrs) else "STRICT_DNS"


def _jwt_filter(j: JwtAuth) -> dict[str, Any]:
    provider: dict[str, Any] = {
        "issuer": j.issuer,
        "local_jwks": {"filename": j.jwks_path},
        "payload_in_metadata": "jwt_payload",
        "forward": False,
    }
    if j.audiences:
        provider["audiences"] = list(j.audiences)
    requires: dict[str, Any] = {"provider_name": "main"}
    if not j.required:
        requires = {"requires_any": {"requirements": [requires, {"allow_missing_or_failed": {}}]}}
    return {
        "name": "envoy.filters.http.jwt_authn",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
            "providers": {"main": provider},
            "rules": [{"match": {"prefix": "/"}, "requires": requires}],
        },
    }


def _strip_headers(names: tuple[str, ...]) -> dict[str, Any]:
    """The first filter: client-sent copies of the trusted identity headers are removed."""
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": n.lower()} for n in names]},
        },
    }


def _decompressor(direction: str) -> dict[str, Any]:
    """gzip decoding for one direction: requests before ext_proc reads them, responses
    before it meters them (the processor still decodes what slips past, see core/encoding)."""
    on = {"common_config": {"enabled": {"default_value": True, "runtime_key": f"aiq_{direction}"}}}
    off = {
        "common_config": {"enabled": {"default_value": False, "runtime_key": f"aiq_no_{direction}"}}
    }
    return {
        "name": f"envoy.filters.http.decompressor.{direction}",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.decompressor.v3.Decompressor",
            "decompressor_library": {
                "name": "gzip",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.compression.gzip.decompressor.v3.Gzip"
                },
            },
            "request_direction_config": {
                **(on if direction == "request" else off),
                "advertise_accept_encoding": False,
            },
            "response_direction_config": on if direction == "response" else off,
        },
    }


def _hcm(name: str, with_filter: bool, p: EnvoyPorts) -> dict[str, Any]:
    filters: list[dict[str, Any]] = []
    if with_filter and p.trusted_headers:
        filters.append(_strip_headers(p.trusted_headers))
    if with_filter:
        filters.extend(p.identity_filters)
    if with_filter and p.jwt is not None:
        filters.append(_jwt_filter(p.jwt))
    if with_filter:
        filters.append(_decompressor("request"))
    if with_filter:
        filters.append(
            {
                "name": "envoy.filters.http.ext_proc",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                    "grpc_service": secure_grpc_service(
                        {
                            "envoy_grpc": {"cluster_name": "extproc"},
                            "timeout": "5s",
                            "retry_policy": {
                                "retry_on": "connect-failure,refused-stream,reset,unavailable",
                                "num_retries": 3,
                                "retry_back_off": {
                                    "base_interval": "0.02s",
                                    "max_interval": "0.2s",
                                },
                                "retry_host_predicate": [
                                    {
                                        "name": "envoy.retry_host_predicates.previous_hosts",
                                        "typed_config": {
                                            "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                                        },
                                    }
                                ],
                                "host_selection_retry_max_attempts": 5,
                            },
                        },
                        p.extproc_auth,
                    ),
                    "failure_mode_allow": False,
                    "status_on_error": {"code": 503},
                    "processing_mode": {
                        "request_header_mode": "SEND",
                        "response_header_mode": "SEND",
                        "request_body_mode": "BUFFERED",
                        "response_body_mode": "NONE",
                        "request_trailer_mode": "SKIP",
                        "response_trailer_mode": "SKIP",
                    },
                    "allow_mode_override": True,
                    "message_timeout": f"{p.message_timeout_ms / 1000:g}s",
                    # a request held for its turn (a plan's ``wait``) asks for this on its
                    # message (override_message_timeout, extproc.core.waiting.HOLD_TIMEOUT_MS)
                    "max_message_timeout": f"{max_message_timeout_s(p.message_timeout_ms):g}s",
                    "metadata_options": {
                        "receiving_namespaces": {"untyped": ["ai_quota"]},
                        **(
                            {"forwarding_namespaces": {"untyped": ["envoy.filters.http.jwt_authn"]}}
                            if p.jwt is not None
                            else {}
                        ),
                    },
                },
            }
        )
        # No response decompressor: Envoy 1.40's decompressor in front of a FULL_DUPLEX_STREAMED
        # ext_proc never delivered the stream's end (measured: the client hangs); the
        # processor decodes gzip/deflate responses itself (core/encoding.py).
    filters.append(
        {
            "name": "envoy.filters.http.router",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
            },
        }
    )
    hcm: dict[str, Any] = {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": name,
            "codec_type": "AUTO",
            "normalize_path": True,
            "merge_slashes": True,
            "path_with_escaped_slashes_action": "UNESCAPE_AND_REDIRECT",
            "stream_idle_timeout": "60s",
            "request_timeout": "0s",
            "route_config": {
                "name": "local",
                "virtual_hosts": [
                    {
                        "name": "all",
                        "domains": ["*"],
                        "routes": [
                            {
                                "match": {"prefix": "/"},
                                "route": {
                                    "cluster": "upstream",
                                    "timeout": "0s",
                                    "idle_timeout": "60s",
                                },
                            }
                        ],
                    }
                ],
            },
            "http_filters": filters,
            "access_log": [
                {
                    "name": "envoy.access_loggers.stdout",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
                        "log_format": {"json_format": dict(ACCESS_LOG_FORMAT)},
                    },
                }
            ],
        },
    }
    if with_filter and p.tracing is not None:
        hcm["typed_config"]["tracing"] = tracing_config(p.tracing)
    return hcm


def _collector(t: EnvoyTracing) -> dict[str, Any]:
    addrs = ((t.collector.host, t.collector.port),)
    return otel_cluster(t, _cluster_type(addrs), _endpoints(addrs))


def _listener(name: str, port: int, with_filter: bool, p: EnvoyPorts) -> dict[str, Any]:
    return {
        "name": name,
        "address": {"socket_address": {"address": p.listen_host, "port_value": port}},
        "per_connection_buffer_limit_bytes": p.max_body_bytes,
        "filter_chains": [{"filters": [_hcm(name, with_filter, p)]}],
    }


def max_message_timeout_s(message_timeout_ms: int) -> float:
    """Envoy's ``max_message_timeout``: what a request waiting for its turn asks for (60 s:
    the longest wait, 50 s, and its last admission call), and at least twice the message
    timeout."""
    return max(HOLD_TIMEOUT_MS / 1000, 2 * message_timeout_ms / 1000)


def render(p: EnvoyPorts) -> dict[str, Any]:
    """The bootstrap as a dict."""
    listeners = [_listener("gateway", p.listen_port, True, p)]
    if p.with_baseline_listener:
        listeners.append(_listener("baseline", p.with_baseline_listener, False, p))
    high = {
        "thresholds": [
            {"max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000}
        ]
    }
    return {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": p.admin_port}}
        },
        "static_resources": {
            "listeners": listeners,
            "clusters": [
                {
                    "name": "upstream",
                    "type": _cluster_type(p.upstreams),
                    "connect_timeout": "2s",
                    "circuit_breakers": high,
                    "per_connection_buffer_limit_bytes": 1048576,
                    "load_assignment": {
                        "cluster_name": "upstream",
                        "endpoints": [{"lb_endpoints": _endpoints(p.upstreams)}],
                    },
                },
                secure_cluster(_extproc_cluster(p, high), p.extproc_auth),
                *([_collector(p.tracing)] if p.tracing is not None else []),
            ],
        },
    }


def _extproc_cluster(p: EnvoyPorts, high: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "extproc",
        "type": _cluster_type(p.extprocs),
        "connect_timeout": "1s",
        "circuit_breakers": high,
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {
                    "http2_protocol_options": {
                        "max_concurrent_streams": 100000,
                        "connection_keepalive": {"interval": "10s", "timeout": "2s"},
                    }
                },
            }
        },
        "health_checks": [_grpc_health_check(p)],
        "outlier_detection": {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 2,
            "consecutive_gateway_failure": 2,
            "interval": "1s",
            "base_ejection_time": "5s",
            "max_ejection_percent": 50,
        },
        "load_assignment": {
            "cluster_name": "extproc",
            "endpoints": [{"lb_endpoints": _endpoints(p.extprocs)}],
        },
    }


def _grpc_health_check(p: EnvoyPorts) -> dict[str, Any]:
    interval = f"{p.health_interval_ms / 1000:g}s"
    return {
        "timeout": f"{max(p.health_interval_ms // 2, 100) / 1000:g}s",
        "interval": interval,
        "no_traffic_interval": interval,
        "unhealthy_interval": interval,
        "interval_jitter": "0.05s",
        "unhealthy_threshold": 1,
        "healthy_threshold": 1,
        "reuse_connection": True,
        "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"},
    }


class _NoAliasDumper(yaml.SafeDumper):
    """A safe dumper that writes every repeated object out again (no ``&id001`` anchors)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


GENERATED = "# Generated by `ai-quota envoy-config`; edit the flags, not this file.\n"
#: The first lines of a bootstrap rendered without the processors' credentials: it works only
#: with processors that accept anyone (``ai-quota serve --insecure``), and says so before
#: anything else (docs/security.md).
PLAINTEXT_WARNING = (
    "# WITHOUT CREDENTIALS: Envoy calls the processors in plaintext with no caller token, so\n"
    "# this bootstrap works only with processors started `ai-quota serve --insecure` (a laptop,\n"
    "# loopback). Anywhere else render it with the port's credentials, e.g.\n"
    "#   ai-quota envoy-config --extproc-token-file TOKEN --extproc-ca CA.pem [...]\n"
    "# (docs/security.md); a processor with a token file refuses this Envoy (UNAUTHENTICATED).\n"
)


def header(p: EnvoyPorts) -> str:
    """The comment lines ``ai-quota envoy-config`` puts above a bootstrap: where it comes from
    and, when Envoy would call the processors without a credential, that it needs processors
    started ``--insecure``."""
    return GENERATED + (PLAINTEXT_WARNING if p.extproc_auth is None else "")


def render_yaml(p: EnvoyPorts, *, header: str = "") -> str:
    """The bootstrap as YAML text (no anchors or aliases: Envoy users read and copy it)."""
    body = yaml.dump(render(p), Dumper=_NoAliasDumper, sort_keys=False, width=120)
    return (header + body) if header else body
