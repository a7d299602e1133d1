"""Process settings from the environment (``AIQ_*``), read once at start-up, never at import.

Parsing is pydantic-settings': each field is read from ``AIQ_<FIELD>`` (``reuse_port`` from
``AIQ_REUSEPORT``) and validated by its type, so ``AIQ_LOG_FORMAT=jsn`` or ``AIQ_WORKERS=x`` is
a :class:`SettingsError` naming the variable instead of a silent fallback or a traceback.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

ENV_PREFIX = "AIQ_"


class SettingsError(ValueError):
    """One or more ``AIQ_*`` variables (or flags) hold a value the field cannot take; the message
    names each variable, the value it held and what was expected, one per line."""


class Settings(BaseSettings):
    """How this process runs (the rules live in the YAML file named by ``config``).

    ``Settings(...)`` takes values only from its arguments (defaults otherwise); the environment
    is read by :meth:`from_env`, which is what the CLI calls."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        frozen=True,
        extra="forbid",
        validate_by_name=True,
        validate_default=True,
        env_ignore_empty=True,
    )

    config: str = "config/demo.yaml"
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Redis HA (docs/operations.md "Redis HA"): how long acknowledged charges are kept for a
    # replay to a new master after a failover or restart (0: no journal, no replay).
    redis_journal_s: float = Field(default=10.0, ge=0, le=600)
    # A stream charge that Redis does not answer is sent again (idempotent) for this long before
    # the stream's failure mode applies: a failover shorter than this cuts no stream (0: at once).
    redis_stream_tolerance_s: float = Field(default=0.0, ge=0, le=60)
    # A call that finds Redis unavailable (a failover, a restart) is sent again (idempotent)
    # for this long before it fails and the plan's failure mode applies: a replica's promotion
    # shorter than this fails no request and cuts no stream (0: fail at once).  Envoy's ext_proc
    # message_timeout must be longer (``ai-quota envoy-config`` renders 12 s).
    redis_failover_wait_s: float = Field(default=8.0, ge=0, le=60)
    grpc_address: str = "127.0.0.1:50051"
    key_prefix: str = "aiq"
    log_format: Literal["json", "console"] = "json"
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    metrics_port: int = Field(default=0, ge=0, le=65535)
    # where the metrics endpoint listens: loopback by default; 0.0.0.0 in a pod Prometheus scrapes
    metrics_host: str = "127.0.0.1"
    usage_address: str = ""
    workers: int = Field(default=1, ge=1)
    reuse_port: bool = Field(default=False, validation_alias="AIQ_REUSEPORT")
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    shutdown_grace_s: float = Field(default=10.0, ge=0)
    # Local allowances (docs/semantics.md "Local allowances"): on by default (AIQ_ALLOWANCES=0
    # turns them off: every admission and charge then goes to Redis).  A replica takes
    # at most ``allowance_share`` of a bucket's remaining room per take, draws from it for at
    # most ``allowance_ttl_ms``, and only for buckets it admits ``allowance_min_rate`` requests
    # a second on, with fixed windows up to ``allowance_max_window_s``.
    allowances: bool = True
    allowance_share: float = Field(default=0.1, gt=0, le=0.5)
    allowance_ttl_ms: int = Field(default=2_000, ge=100, le=60_000)
    allowance_min_rate: float = Field(default=8.0, ge=0)
    allowance_max_window_s: int = Field(default=3_600, ge=1)
    # A take is split into this many tranches: the replica draws only from those it opened
    # (in the background, ahead of need); a SIGKILLed replica's never-opened tranches go back
    # to the tenant once its lease (failure.reservation_lease_seconds) runs out.
    allowance_tranches: int = Field(default=4, ge=1, le=64)
    # How often the usage-record drafts of requests admitted from allowances go to Redis (one
    # call per tenant, batched): a SIGKILL loses the records of those admitted in the last one.
    allowance_draft_flush_ms: int = Field(default=1_000, ge=10, le=5_000)
    # Shift the gateway's wall clock (windows, resets, months) by this many ms: for drills and
    # tests of window boundaries; every replica sharing counters must use the same value.
    clock_offset_ms: int = 0
    # SIGTERM: seconds the health service reports NOT_SERVING while still serving every stream,
    # so Envoy's active health check moves new requests away before the listener closes.
    drain_notice_s: float = Field(default=2.5, ge=0)
    # Usage records (docs/usage-records.md): the Redis Stream they are appended to
    # (AIQ_USAGE_STREAM=off disables them) and its approximate bound (XADD MAXLEN ~).
    usage_stream: str = "aiq:usage"
    usage_stream_maxlen: int = Field(default=1_000_000, ge=1)
    # Tenants and keys changed at run time (docs/admin.md): every replica follows the Redis
    # admin store unless AIQ_ADMIN_STORE=0; the admin gRPC API listens on admin_host:admin_port
    # (0: off) behind the bearer token in admin_token_file and/or client certificates signed
    # by admin_tls_client_ca, with TLS from admin_tls_cert/key (required off loopback unless
    # admin_allow_plaintext: a proxy in front terminates TLS).
    admin_store: bool = True
    admin_port: int = Field(default=0, ge=0, le=65535)
    admin_host: str = "127.0.0.1"
    admin_token_file: str = ""
    admin_tls_cert: str = ""
    admin_tls_key: str = ""
    admin_tls_client_ca: str = ""
    admin_allow_plaintext: bool = False
    # The RLS API (envoyproxy/ratelimit's ShouldRateLimit, docs/rls.md): its config (a YAML
    # file or a directory of them, one per domain; "": the RLS API is not served at all), a
    # separate listen address ("" = the ext_proc server's), what Redis down answers (allow |
    # deny | error: gRPC UNAVAILABLE, Envoy's failure_mode_deny decides), their NEAR_LIMIT_RATIO,
    # SHADOW_MODE, LIMIT_RESPONSE_HEADERS_ENABLED and RESPONSE_DYNAMIC_METADATA, and how often
    # the files are checked for changes (0: only on SIGHUP).
    rls_config: str = ""
    rls_address: str = ""
    rls_failure_mode: Literal["allow", "deny", "error"] = "error"
    rls_near_limit_ratio: float = Field(default=0.8, gt=0, le=1)
    rls_shadow_mode: bool = False
    rls_response_headers: bool = False
    rls_dynamic_metadata: bool = False
    rls_watch_s: float = Field(default=1.0, ge=0)
    # The gRPC port's door (docs/security.md): callers of ext_proc and RLS (Envoy) present a
    # bearer token from grpc_token_file (one per line: two during a rotation) and/or a client
    # certificate signed by grpc_tls_client_ca whose SAN is in grpc_allowed_sans (comma-
    # separated; "" = any the CA signed); TLS from grpc_tls_cert/key (reloaded when they
    # change); tokens in plaintext off loopback only with grpc_allow_plaintext (a mesh
    # terminates TLS); no credential at all only with insecure (AIQ_INSECURE=1, --insecure).
    insecure: bool = False
    grpc_token_file: str = ""
    grpc_tls_cert: str = ""
    grpc_tls_key: str = ""
    grpc_tls_client_ca: str = ""
    grpc_allowed_sans: str = ""
    grpc_allow_plaintext: bool = False
    # grpc.health.v1 alone, in plaintext, on its own host:port ("" = none): for probes that
    # cannot speak TLS (the kubelet's gRPC probes) when the main port is TLS-only.
    health_address: str = ""

    @property
    def allowed_sans(self) -> list[str]:
        """``grpc_allowed_sans`` as a list (comma-separated in the variable)."""
        return [s.strip() for s in self.grpc_allowed_sans.split(",") if s.strip()]

    # What one ShouldRateLimit may carry (each exceeded cap: INVALID_ARGUMENT naming it), and
    # how many distinct detailed_metric values one rule may label (the rest: the rule's path).
    rls_max_descriptors: int = Field(default=32, ge=1, le=1024)
    rls_max_entries: int = Field(default=16, ge=1, le=256)
    rls_max_key_length: int = Field(default=128, ge=1, le=8192)
    rls_max_value_length: int = Field(default=512, ge=1, le=65536)
    rls_max_hits_addend: int = Field(default=1_000_000, ge=1, le=2**32)
    rls_detailed_metric_series: int = Field(default=100, ge=0, le=100_000)

    @field_validator("redis_url")
    @classmethod
    def _redis_url_parses(cls, value: str) -> str:
        from extproc.limiter.redis_url import parse_redis_url

        parse_redis_url(value)  # a RedisUrlError (a ValueError) names what is wrong
        return value

    @field_validator("usage_stream", mode="before")
    @classmethod
    def _usage_stream_off(cls, value: object) -> object:
        off = isinstance(value, str) and value.strip().lower() in ("", "off", "none", "false", "0")
        return "" if off else value

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_any_case(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Only constructor arguments: the environment enters through ``from_env`` (which may be
        # given a mapping other than ``os.environ``), never implicitly, and no .env/secret files.
        return (init_settings,)

    @classmethod
    def env_name(cls, field: str) -> str:
        """The environment variable a field is read from (``workers`` -> ``AIQ_WORKERS``)."""
        alias = cls.model_fields[field].validation_alias
        return alias if isinstance(alias, str) else ENV_PREFIX + field.upper()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> Settings:
        """Read ``AIQ_CONFIG``, ``AIQ_REDIS_URL``, ``AIQ_REDIS_JOURNAL_S``,
        ``AIQ_REDIS_STREAM_TOLERANCE_S``, ``AIQ_REDIS_FAILOVER_WAIT_S``, ``AIQ_GRPC_ADDRESS``, ``AIQ_KEY_PREFIX``,
        ``AIQ_LOG_FORMAT`` (json|console), ``AIQ_LOG_LEVEL``, ``AIQ_METRICS_PORT``,
        ``AIQ_USAGE_ADDRESS``, ``AIQ_WORKERS``, ``AIQ_REUSEPORT`` (1|0|true|false),
        ``AIQ_EVENT_LOOP`` (uvloop|asyncio), ``AIQ_SHUTDOWN_GRACE_S``, ``AIQ_DRAIN_NOTICE_S``,
        ``AIQ_ADMIN_STORE``, ``AIQ_ADMIN_PORT``, ``AIQ_ADMIN_HOST``, ``AIQ_ADMIN_TOKEN_FILE``,
        ``AIQ_ADMIN_TLS_CERT``, ``AIQ_ADMIN_TLS_KEY``, ``AIQ_ADMIN_TLS_CLIENT_CA``,
        ``AIQ_ADMIN_ALLOW_PLAINTEXT``, ``AIQ_RLS_*`` (docs/rls.md), ``AIQ_INSECURE``,
        ``AIQ_GRPC_TOKEN_FILE``, ``AIQ_GRPC_TLS_CERT``, ``AIQ_GRPC_TLS_KEY``,
        ``AIQ_GRPC_TLS_CLIENT_CA``, ``AIQ_GRPC_ALLOWED_SANS``, ``AIQ_GRPC_ALLOW_PLAINTEXT``,
        ``AIQ_HEALTH_ADDRESS`` (docs/security.md) from
        ``env`` (default ``os.environ``); explicit non-None ``overrides`` (CLI flags) win.

        Raises :class:`SettingsError` naming every variable whose value is invalid."""
        source = _MappingEnvSource(cls, os.environ if env is None else env)
        from_environment = {_field_of(cls, key): value for key, value in source().items()}
        given = {k: v for k, v in overrides.items() if v is not None}
        try:
            return cls(**{**from_environment, **given})
        except ValidationError as exc:
            raise SettingsError(_describe(cls, exc, set(given))) from None


class _MappingEnvSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping instead of ``os.environ``."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = dict(environ)
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        # Case-insensitive names (the source lower-cases what it looks up); an empty variable
        # counts as unset, like ``env_ignore_empty`` does for ``os.environ``.
        return {k.lower(): v for k, v in self._environ.items() if v != ""}


def _field_of(cls: type[Settings], key: str) -> str:
    """The field a source key stands for (sources key aliased fields by their alias)."""
    if key in cls.model_fields:
        return key
    for name, info in cls.model_fields.items():
        if info.validation_alias == key:
            return name
    return key


def _describe(cls: type[Settings], exc: ValidationError, from_flags: set[str]) -> str:
    lines = []
    for err in exc.errors():
        loc = str(err["loc"][0]) if err["loc"] else ""
        field = _field_of(cls, loc)
        value: Any = err.get("input")
        if field == "redis_url" and isinstance(value, str):
            from extproc.limiter.redis_url import redact

            value = redact(value)  # never a password in an error message
        if field in from_flags:
            where = f"--{field.replace('_', '-')}={value}"
        elif field in cls.model_fields:
            where = f"{cls.env_name(field)}={value!r}"
        else:
            where = field
        lines.append(f"{where}: {err['msg']}")
    return "invalid settings:\n  " + "\n  ".join(lines)
