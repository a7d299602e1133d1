"""The compiled, frozen configuration the gateway runs on.

Built once by :func:`extproc.config.load.compile_config`; lookups on the request path
are dictionary gets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from extproc.config.schema import EndUserPolicy, IdentityPolicy
from extproc.core.figures import ABANDONED_TOKENS_PER_SECOND
from extproc.core.rules import Charging, Limit, Rates
from extproc.core.tokens import TokenCounter, TokenizerSpec
from extproc.core.waiting import WaitRule


@dataclass(frozen=True, slots=True)
class Model:
    """A metered model."""

    name: str
    aliases: tuple[str, ...]
    tokenizer: TokenizerSpec
    counter: TokenCounter
    max_output_tokens: int
    max_input_tokens: int | None
    known: bool = True
    delta_count: Callable[[str], int] | None = None
    # counts at least what ``counter`` does, without tokenizing (None: no proven bound)
    bound_counter: TokenCounter | None = None
    # prices as rates (micro-units of the currency per million tokens); None: not priced
    prices: Rates | None = None
    currency: str = ""
    # the upstream reports running usage in every stream chunk when asked (vLLM, SGLang)
    continuous_usage: bool = False
    # output tokens per second per sequence billed for a request abandoned before its response
    abandoned_tokens_per_second: int = ABANDONED_TOKENS_PER_SECOND
    # non-streaming requests are sent upstream as streams and their JSON rebuilt (exact path)
    exact_non_streams: bool = False
    # tokens per upstream chunk the exact path asks the engine for (vLLM's stream_interval)
    exact_stream_interval: int | None = None

    @property
    def exact_count(self) -> bool:
        """Counted by the model's own tokenizer (not estimated): the upstream's input figure is
        then trusted within bounds around the count; an estimate is kept as charged."""
        return self.known and self.tokenizer.kind != "estimate"

    def stream_counter(self) -> Callable[[str], int]:
        """The per-delta counter for streams (memoised), or the plain one."""
        return self.delta_count or self.counter.count


@dataclass(frozen=True, slots=True)
class Plan:
    """A plan's limits and charging overrides."""

    name: str
    limits: tuple[Limit, ...]


@dataclass(frozen=True, slots=True)
class Membership:
    """Where a key sits among the levels (docs/semantics.md, "Levels"): its team, and every
    limit that applies to it (its tenant's, its team's, its organisation's, per end user)."""

    team: str
    limits: tuple[Limit, ...]
    strict: bool = False  # a level of it asks for strict streaming


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant with its resolved limits (plan's, overridden by its own), and the levels it
    belongs to: its limits hold its team's and organisation's too; a key in another team
    than the tenant's has its own :class:`Membership`."""

    id: str
    plan: str
    limits: tuple[Limit, ...]
    organisation: str = ""
    team: str = ""
    strict: bool = False  # a level of the tenant asks for strict streaming
    members: dict[str, Membership] = field(default_factory=dict, hash=False)

    @property
    def slot(self) -> str:
        """What its Redis keys are named by (:func:`extproc.core.keys.slot_id`): the tenant,
        or its organisation's hash tag and the tenant."""
        return f"@o.{self.organisation}/{self.id}" if self.organisation else self.id

    def limits_for(self, key_name: str) -> tuple[Limit, ...]:
        """Every limit a request of key ``key_name`` is counted in."""
        m = self.members.get(key_name) if self.members else None
        return self.limits if m is None else m.limits

    def team_of(self, key_name: str) -> str:
        """The team of key ``key_name`` ("" when none)."""
        m = self.members.get(key_name) if self.members else None
        return self.team if m is None else m.team

    def strict_for(self, key_name: str) -> bool:
        """Whether a level of key ``key_name`` asks for strict streaming."""
        m = self.members.get(key_name) if self.members else None
        return self.strict if m is None else m.strict


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A known key: its name (safe to log) and tenant. The secret itself is never kept."""

    name: str
    tenant: str

    def __repr__(self) -> str:
        return f"ApiKey(name={self.name!r}, tenant={self.tenant!r})"


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """Everything the request path needs, precomputed."""

    source: str
    models: dict[str, Model]
    aliases: dict[str, str]
    unknown_model_action: Literal["reject", "estimate"]
    unknown_model_status: int
    unknown_model: Model
    tenants: dict[str, Tenant]
    keys_by_digest: dict[str, ApiKey] = field(repr=False)
    charging: dict[tuple[str, str], Charging]
    default_charging: dict[str, Charging]
    metered_paths: frozenset[str]
    other_paths: Literal["passthrough", "reject", "rpm_only"]
    allowed_paths: tuple[str, ...]
    max_body_bytes: int
    max_tokens_ceiling: int
    over_model_cap: Literal["clamp", "reject"]
    max_n: int
    count_refused_requests: bool
    force_include_usage: bool
    failure_mode: Literal["closed", "open"]
    redis_timeout_ms: int
    breaker_cooldown_ms: int
    ledger_ttl_seconds: int
    reservation_lease_ms: int = 15_000
    count_deadline_ms: int = 4000
    admit_on_bound: bool = False
    bound_headroom: float = 4.0
    bound_below: float = 0.25
    input_audit_every: int = 16
    identity: IdentityPolicy = field(default_factory=IdentityPolicy)
    end_users: EndUserPolicy = field(default_factory=EndUserPolicy)
    # organisation -> its teams (docs/semantics.md, "Levels"), for usage and the admin API
    organisations: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # ("organisation" | "team", id) -> the level's own limits (a team's: per end user too)
    level_limits: dict[tuple[str, str], tuple[Limit, ...]] = field(default_factory=dict)

    def organisation_of_team(self, team: str) -> str | None:
        """The organisation team ``team`` is in (None: no such team)."""
        for org, teams in self.organisations.items():
            if team in teams:
                return org
        return None

    plaintext_keys: int = 0
    plan_failure_modes: dict[str, Literal["closed", "open"]] = field(default_factory=dict)
    # plan -> requested model -> fallback model (canonical names)
    fallbacks: dict[str, dict[str, str]] = field(default_factory=dict)
    # plan -> its wait for room (docs/semantics.md, "Waiting"); absent: refused at once
    plan_waits: dict[str, WaitRule] = field(default_factory=dict)
    # (tenant, key name) -> the key's own wait, over its plan's
    key_waits: dict[tuple[str, str], WaitRule] = field(default_factory=dict)
    max_waiters_per_replica: int = 1000
    # allow-listed paths that pass without an identity (load balancer probes, model listings)
    public_paths: tuple[str, ...] = ()

    def resolve_model(self, name: str) -> Model | None:
        """The configured model for ``name`` or one of its aliases."""
        canonical = self.aliases.get(name, name)
        return self.models.get(canonical)

    def wait_for(self, plan: str, tenant: str, key: str) -> WaitRule | None:
        """The wait of a request of ``tenant``'s ``key`` on ``plan``: the key's, else the
        plan's (None: refused at once)."""
        return self.key_waits.get((tenant, key)) or self.plan_waits.get(plan)

    def failure_mode_for(self, plan: str) -> Literal["closed", "open"]:
        """What to do when Redis is unreachable: the plan's choice, else the file's."""
        return self.plan_failure_modes.get(plan, self.failure_mode)

    def charging_for(self, plan: str, model: str) -> Charging:
        """Charging settings: plan's over model's over the file's defaults."""
        found = self.charging.get((plan, model))
        if found is not None:
            return found
        return self.default_charging.get(plan) or self.default_charging.get("", Charging())
