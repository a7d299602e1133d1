"""The YAML rules file, validated strictly: unknown keys and wrong types are rejected.

The models here mirror the file one to one; :mod:`extproc.config.load` compiles them
into :class:`extproc.config.runtime.RuntimeConfig`.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from extproc.config.strict import Strict
from extproc.config.wait_schema import WaitEntry

IDENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

ChargingMode = Literal["input_only", "reserve_max", "reserve_refund", "stream_incremental"]
StreamingMode = Literal["lazy", "strict"]
FailureMode = Literal["closed", "open"]
WindowName = Literal["second", "minute", "hour", "day", "week", "month"]

#: ISO 4217 codes a budget may be kept in (counters hold micro-units of it).
CURRENCIES = frozenset(
    [
        "USD",
        "EUR",
        "GBP",
        "JPY",
        "CNY",
        "INR",
        "CAD",
        "AUD",
        "CHF",
        "SEK",
        "NOK",
        "DKK",
        "PLN",
        "CZK",
        "HUF",
        "RON",
        "BGN",
        "ISK",
        "BRL",
        "MXN",
        "ARS",
        "CLP",
        "COP",
        "PEN",
        "UYU",
        "KRW",
        "SGD",
        "HKD",
        "TWD",
        "NZD",
        "ZAR",
        "TRY",
        "ILS",
        "AED",
        "SAR",
        "QAR",
        "KWD",
        "EGP",
        "NGN",
        "KES",
        "MAD",
        "THB",
        "IDR",
        "MYR",
        "PHP",
        "VND",
        "PKR",
        "BDT",
        "LKR",
        "UAH",
        "KZT",
    ]
)


class TokenizerModel(Strict):
    """How a model's tokens are counted."""

    kind: Literal["tiktoken", "huggingface", "estimate"] = "tiktoken"
    encoding: str | None = None
    path: str | None = None
    chars_per_token: float = Field(default=3.0, gt=0, allow_inf_nan=False)
    safety_factor: float = Field(default=1.25, ge=1.0, allow_inf_nan=False)
    tokens_per_message: int = Field(default=3, ge=0)
    tokens_per_name: int = Field(default=1, ge=0)
    reply_priming_tokens: int = Field(default=3, ge=0)
    image_tokens: int = Field(default=765, ge=0)

    @model_validator(mode="after")
    def _check_kind(self) -> TokenizerModel:
        if self.kind == "tiktoken" and not self.encoding:
            raise ValueError("a tiktoken tokenizer needs 'encoding' (e.g. cl100k_base)")
        if self.kind == "huggingface" and not self.path:
            raise ValueError("a huggingface tokenizer needs 'path' to a tokenizer.json")
        return self


class ChargingModel(Strict):
    """How a request is charged against TPM; every field optional so levels can override."""

    mode: ChargingMode | None = None
    streaming: StreamingMode | None = None
    charge_every_tokens: int | None = Field(default=None, ge=1, le=100_000)


class Pricing(Strict):
    """What a model's tokens cost, per million tokens (``request``: per request), in
    ``currency``; cached input defaults to the input price, reasoning to the output price."""

    currency: str = "USD"
    input: float = Field(ge=0, allow_inf_nan=False)
    cached_input: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    output: float = Field(ge=0, allow_inf_nan=False)
    reasoning: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    request: float = Field(default=0.0, ge=0, allow_inf_nan=False)

    @field_validator("currency")
    @classmethod
    def _currency(cls, v: str) -> str:
        if v not in CURRENCIES:
            raise ValueError(f"unknown currency {v!r} (an ISO 4217 code such as USD or EUR)")
        return v


class Weights(Strict):
    """Weighted tokens: what one token of each kind counts (cached input defaults to the
    input weight, reasoning to the output weight)."""

    input: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    cached_input: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    output: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    reasoning: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class ModelEntry(Strict):
    """One model the gateway meters."""

    aliases: list[str] = Field(default_factory=list)
    tokenizer: TokenizerModel
    max_output_tokens: int = Field(ge=1, le=10_000_000)
    max_input_tokens: int | None = Field(default=None, ge=1)
    charging: ChargingModel = Field(default_factory=ChargingModel)
    pricing: Pricing | None = None
    # "continuous": the upstream engine reports running usage in every stream chunk when asked
    # (vLLM, SGLang: stream_options.continuous_usage_stats); chat and completions streams then
    # ask for it and are metered by the engine's own count (docs/streaming-counting.md)
    stream_usage: Literal["final", "continuous"] = "final"
    # What the upstream generates per second per sequence for this model: a request abandoned
    # before its response is billed its input and this many output tokens per second it ran
    # (never more than it reserved). Set it to the engine's decode speed (docs/semantics.md).
    abandoned_tokens_per_second: int = Field(default=200, ge=0, le=1_000_000)
    # How a non-streaming request is sent upstream: "json" (the default) forwards it as sent
    # and reads its JSON's usage; an abandon is billed its input and the model's decode rate
    # (learned from its completed responses, this figure until then) times the time it ran.
    # "exact" sends it as a stream with usage, keeps what passes and gives the client the
    # API's JSON rebuilt from it: an abandon settles on what the engine generated, at the
    # CPU of one ext_proc message per SSE chunk (docs/performance.md: 1.3-2.5x the JSON
    # path's processor CPU from 64 output tokens up). Embeddings never stream.
    non_streams: Literal["exact", "json"] = "json"
    # On the exact path, ask the engine to send this many tokens per stream chunk (vLLM's
    # per-request "stream_interval", chat and completions; an upstream that does not know the
    # field may refuse it): one ext_proc message per chunk instead of per token, and an
    # abandon misses at most this many tokens less one (generated, not yet sent). None: not
    # asked (docs/semantics.md, docs/performance.md "Exact non-streams": 1.1-1.3x the JSON
    # path's processor CPU with 16).
    exact_stream_interval: int | None = Field(default=None, ge=2, le=16)

    @model_validator(mode="after")
    def _check_exact(self) -> ModelEntry:
        if self.exact_stream_interval is not None and self.non_streams != "exact":
            raise ValueError("'exact_stream_interval' applies to 'non_streams: exact' only")
        return self


class LimitEntry(Strict):
    """One rule for a model (or ``*`` = all models together) over a window: requests, tokens,
    a money budget, weighted tokens, and/or requests open at once (``concurrency``)."""

    model: str = "*"
    scope: Literal["tenant", "key"] = "tenant"
    # a named window, or a length in seconds ("10s": 1 to 86400 seconds, fixed in UTC)
    per: str = "minute"
    time_zone: str = "UTC"  # days, weeks and months follow this zone's calendar
    rpm: int | None = Field(default=None, ge=0)
    tpm: int | None = Field(default=None, ge=0)
    budget: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    currency: str | None = None  # default: the file's ``currency``
    weighted_tokens: int | None = Field(default=None, ge=0)
    weights: Weights | None = None
    concurrency: int | None = Field(default=None, ge=0)
    shadow: bool = False  # counted and reported, never refuses or cuts
    # fixed: counters start from zero at each window; sliding: the previous window still counts
    # for the share of it inside the last window-length (docs/semantics.md, "Sliding windows")
    window: Literal["fixed", "sliding"] = "fixed"

    @model_validator(mode="after")
    def _check_any(self) -> LimitEntry:
        kinds = (self.rpm, self.tpm, self.budget, self.weighted_tokens, self.concurrency)
        if all(k is None for k in kinds):
            raise ValueError(
                "a limit needs at least one of 'rpm', 'tpm', 'budget', 'weighted_tokens' or "
                "'concurrency'"
            )
        if (self.weighted_tokens is None) != (self.weights is None):
            raise ValueError("'weighted_tokens' and 'weights' go together")
        if self.currency is not None and self.budget is None:
            raise ValueError("'currency' applies to a 'budget' only")
        if self.currency is not None and self.currency not in CURRENCIES:
            raise ValueError(f"unknown currency {self.currency!r} (an ISO 4217 code)")
        if self.per[:-1].isdigit():
            if int(self.per[:-1]) > 86_400:
                raise ValueError(f"a window of {self.per} is longer than a day: name it ('day')")
            if self.time_zone != "UTC":
                raise ValueError("a window of a length in seconds is in UTC (no 'time_zone')")
        if self.window == "sliding" and (self.per == "month" or self.time_zone != "UTC"):
            raise ValueError(
                "a sliding window needs a fixed length: per second, minute, hour, day or week, "
                "in UTC"
            )
        return self

    @field_validator("per")
    @classmethod
    def _per(cls, v: str) -> str:
        if v in ("second", "minute", "hour", "day", "week", "month") or re.fullmatch(
            r"[1-9][0-9]{0,4}s", v
        ):
            return v
        raise ValueError(
            f"unknown window {v[:40]!r}: second, minute, hour, day, week, month, or a length "
            "in seconds such as '10s'"
        )

    @field_validator("time_zone")
    @classmethod
    def _zone(cls, v: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(v)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(
                f"unknown time zone {v!r} (an IANA name such as Europe/Berlin)"
            ) from None
        return v


class PlanEntry(Strict):
    """A plan: the limits every tenant on it gets, and optional charging overrides."""

    description: str = ""
    limits: list[LimitEntry] = Field(default_factory=list)
    charging: ChargingModel = Field(default_factory=ChargingModel)
    failure_mode: FailureMode | None = None
    shadow: bool = False  # every limit of the plan is a shadow limit
    # requested model -> the model to serve instead when a limit on the requested one refuses
    # at admission (never mid-stream); the answer says so in x-aiquota-fallback-model
    fallback: dict[str, str] = Field(default_factory=dict)
    # wait for room instead of an immediate 429 (None: refuse at once)
    wait: WaitEntry | None = None


class KeyEntry(Strict):
    """An API key, stored as its SHA-256 digest (hex). ``plaintext`` is for local demos only."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    team: str | None = None  # the team the key is in (default: its tenant's)
    sha256: str | None = None
    plaintext: str | None = Field(default=None, description="DEMO ONLY: never put real keys here")
    wait: WaitEntry | None = None  # this key's wait, over its plan's (docs/semantics.md)

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[0-9a-f]{64}", v):
            raise ValueError("sha256 must be 64 lower-case hex characters")
        return v

    @model_validator(mode="after")
    def _one(self) -> KeyEntry:
        if (self.sha256 is None) == (self.plaintext is None):
            raise ValueError("a key needs exactly one of 'sha256' or 'plaintext'")
        return self


class TenantEntry(Strict):
    """A tenant: its plan, its keys, and limits that override the plan's; optionally inside
    an organisation (directly, or through a team: docs/semantics.md, "Levels")."""

    plan: str
    keys: list[KeyEntry] = Field(default_factory=list)  # none: identified by JWT or header
    limits: list[LimitEntry] = Field(default_factory=list)
    organisation: str | None = None
    team: str | None = None  # the team of its keys that name none


class EndUserLimits(Strict):
    """Limits every end user of a team gets, each counted apart, and the cap on how many
    distinct end users the team may have per window (a new one beyond it is refused)."""

    limits: list[LimitEntry] = Field(min_length=1)
    max_users: int = Field(default=10_000, ge=1, le=1_000_000)
    per: WindowName = "minute"


class LevelCharging(Strict):
    """A level's streaming choice: ``strict`` makes every request it covers strict."""

    streaming: StreamingMode | None = None


class OrganisationEntry(Strict):
    """An organisation: limits shared by every team, tenant and key inside it."""

    description: str = ""
    limits: list[LimitEntry] = Field(default_factory=list)
    charging: LevelCharging = Field(default_factory=LevelCharging)


class TeamEntry(Strict):
    """A team inside an organisation: limits shared by its tenants and keys, and per end user."""

    organisation: str
    description: str = ""
    limits: list[LimitEntry] = Field(default_factory=list)
    end_users: EndUserLimits | None = None
    charging: LevelCharging = Field(default_factory=LevelCharging)


EndUserSource = Literal["body", "header", "jwt"]


def _body_only() -> list[EndUserSource]:
    return ["body"]


class EndUserPolicy(Strict):
    """Where a request's end user is named, tried in order: ``body`` (OpenAI's ``user``,
    Anthropic's ``metadata.user_id``), ``header`` (set by a filter you trust), ``jwt`` (a claim
    of the verified token).  A request naming none is counted as the end user ``-``."""

    sources: list[EndUserSource] = Field(default_factory=_body_only, min_length=1)
    header: str = "x-end-user"
    jwt_claim: str = "user"


class PathsPolicy(Strict):
    """What happens to paths other than the metered API endpoints.

    ``allow`` lists paths that pass unmetered with a valid identity (a trailing ``*`` matches
    any rest); those of them also in ``public`` pass without one (a load balancer's probe, a
    client's model listing; a key that is presented must still be valid); every other path
    follows ``other``: ``reject`` (404, the default: an endpoint the gateway does not meter may
    generate tokens for free), ``rpm_only`` (counted as a request, no tokens) or
    ``passthrough`` (unmetered, at your own risk).
    """

    other: Literal["passthrough", "reject", "rpm_only"] = "reject"
    allow: list[str] = Field(
        default_factory=lambda: ["/v1/models", "/v1/models/*", "/health", "/ping", "/version"]
    )
    public: list[str] = Field(
        default_factory=lambda: ["/v1/models", "/v1/models/*", "/health", "/ping", "/version"]
    )
    metered: list[str] = Field(
        default_factory=lambda: [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/responses",
            "/v1/messages",
            "/v1/embeddings",
        ]
    )


class UnknownModelPolicy(Strict):
    """Requests naming a model that is not configured."""

    action: Literal["reject", "estimate"] = "reject"
    status: Literal[400, 404] = 404
    max_output_tokens: int = Field(default=4096, ge=1)
    pricing: Pricing | None = None  # what money budgets charge for an unknown model
    tokenizer: TokenizerModel = Field(
        default_factory=lambda: TokenizerModel(
            kind="estimate", chars_per_token=3.0, safety_factor=1.25
        )
    )


class RequestsPolicy(Strict):
    """Limits on the request itself."""

    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    max_tokens_ceiling: int = Field(default=1_000_000, ge=1)
    over_model_cap: Literal["clamp", "reject"] = "clamp"
    max_n: int = Field(default=16, ge=1, le=128)
    count_refused_requests: bool = False
    force_include_usage: bool = True
    # Counting a prompt (queue for a counting thread included) is given up after this, with a
    # JSON 503 to retry; keep it below Envoy's ext_proc message_timeout (5 s in envoy-config).
    count_deadline_ms: int = Field(default=4000, ge=100, le=60_000)
    # Off (the default): every prompt is counted with the model's tokenizer before admission,
    # so a processor killed at any moment leaves ledgers holding exact inputs.  On: admit on an
    # upper bound of the prompt's tokens (its UTF-8 length, for tiktoken models) and count
    # exactly after the request is on its way, where every per-token counter was last seen
    # with room for bound_headroom times the request's charge (less CPU; a processor killed
    # within a request's first 0.25 s bills that request its bound).  docs/semantics.md,
    # "Admission on a bound".
    admit_on_bound: bool = False
    bound_headroom: float = Field(default=4.0, ge=1.0, le=1000.0)
    # ... and only while that leaves every such counter under this share of its limit: many
    # requests admitted on bounds at once then hold at most about this share beyond their counts
    bound_below: float = Field(default=0.25, gt=0.0, le=1.0)
    # A request admitted on the bound is billed the upstream's input figure when it is in the
    # range the bound proves, without counting; one in input_audit_every is counted anyway, and
    # a model whose figure a count contradicts is counted from then on (1: count every one).
    input_audit_every: int = Field(default=16, ge=1, le=1_000_000)
    # Requests one processor holds waiting for their turn (plans with ``wait``) at most;
    # beyond it a request over its limit is refused at once.
    max_waiters_per_replica: int = Field(default=1000, ge=0, le=100_000)


class FailurePolicy(Strict):
    """What the gateway does when Redis cannot answer."""

    mode: FailureMode = "closed"
    timeout_ms: int = Field(default=250, ge=10, le=10_000)
    breaker_cooldown_ms: int = Field(default=1000, ge=0)
    # An admitted request's reservation is leased this long and renewed while it runs; a
    # processor killed without settling leaks its reservations for at most this long (they
    # are refunded by the tenant's next admission after it).
    reservation_lease_seconds: int = Field(default=15, ge=3, le=3600)


class JwtIdentity(Strict):
    """The caller from a JWT Envoy's ``jwt_authn`` filter verified (``payload_in_metadata``),
    forwarded to the processor with ext_proc's ``metadata_options``."""

    metadata_namespace: str = "envoy.filters.http.jwt_authn"
    payload_key: str = "jwt_payload"
    # dotted path of the claim naming the tenant, and of the one naming the key/user (per-key
    # limits apply to it); tenant_map maps claim values to tenant ids (empty: the value is one)
    tenant_claim: str = "tenant"
    key_claim: str | None = "sub"
    tenant_map: dict[str, str] = Field(default_factory=dict)


class HeaderIdentity(Strict):
    """The caller from headers an earlier Envoy filter (ext_authz, Lua) set after removing any
    the client sent; never enable this without that removal (docs/identity.md)."""

    tenant_header: str = "x-authenticated-tenant"
    key_header: str | None = "x-authenticated-user"


IdentitySource = Literal["api_key", "jwt", "header"]


def _api_key_only() -> list[IdentitySource]:
    return ["api_key"]


class IdentityPolicy(Strict):
    """Where the caller's identity comes from, tried in order; none found is a 401."""

    sources: list[IdentitySource] = Field(default_factory=_api_key_only, min_length=1)
    jwt: JwtIdentity = Field(default_factory=JwtIdentity)
    header: HeaderIdentity = Field(default_factory=HeaderIdentity)


class ConfigFile(Strict):
    """The whole rules file."""

    version: Literal[1] = 1
    currency: str = "USD"  # of budgets that name none
    charging: ChargingModel = Field(default_factory=ChargingModel)
    models: dict[str, ModelEntry] = Field(min_length=1)
    unknown_models: UnknownModelPolicy = Field(default_factory=UnknownModelPolicy)
    plans: dict[str, PlanEntry] = Field(min_length=1)
    tenants: dict[str, TenantEntry] = Field(min_length=1)
    organisations: dict[str, OrganisationEntry] = Field(default_factory=dict)
    teams: dict[str, TeamEntry] = Field(default_factory=dict)
    end_users: EndUserPolicy = Field(default_factory=EndUserPolicy)
    paths: PathsPolicy = Field(default_factory=PathsPolicy)
    requests: RequestsPolicy = Field(default_factory=RequestsPolicy)
    failure: FailurePolicy = Field(default_factory=FailurePolicy)
    identity: IdentityPolicy = Field(default_factory=IdentityPolicy)
    # How long a request's ledger lives in Redis; load.py also requires at least the longest
    # window in use (capped at an hour), see LEDGER_TTL_FLOOR_S there and docs/operations.md.
    ledger_ttl_seconds: int = Field(default=3600, ge=300)
