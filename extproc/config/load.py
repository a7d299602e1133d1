"""Load a rules file: parse YAML, validate strictly, compile into :class:`RuntimeConfig`.

Every error names the file, the line and column where they can be found, and the path inside
the document (``rules.yaml:7:5: models.sim-small.tokenizer.encoding: ...``; list items as
``[0]``).  The YAML is read by :class:`extproc.config.source.RulesLoader`, which refuses
duplicate keys, so ``check-config``, ``serve`` and a SIGHUP reload all read a file the same way.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pydantic import ValidationError

from extproc.config import levels, schema
from extproc.config.runtime import ApiKey, Membership, Model, Plan, RuntimeConfig, Tenant
from extproc.config.source import YamlSyntaxError, locate, parse_rules, render_path, where
from extproc.config.waits import key_wait_rules, wait_rules
from extproc.core.counters import upper_bound_counter
from extproc.core.rules import (
    RATE_SCALE,
    Charging,
    Limit,
    Metric,
    Rates,
    window_period,
    window_seconds,
)
from extproc.core.tokens import TokenizerSpec, delta_counter
from extproc.tokenizers.errors import TokenizerLoadError
from extproc.tokenizers.registry import TokenizerRegistry

UNKNOWN_MODEL_NAME = "(unknown)"


#: Ledgers live at least this long: more than the longest stream plus the time kept settlements
#: wait for Redis.  A file's ``ledger_ttl_seconds`` must also cover its longest window (up to
#: an hour), so a request's refund always finds its ledger while its window's counters exist.
LEDGER_TTL_FLOOR_S = 300


def ledger_ttl_minimum(longest_window_s: int) -> int:
    """The smallest ``ledger_ttl_seconds`` accepted for rules whose longest window is this."""
    return max(LEDGER_TTL_FLOOR_S, min(longest_window_s, 3600))


class ConfigError(ValueError):
    """The rules file is invalid. ``str()`` names the file and every offending path."""


def load_config(path: str | Path) -> RuntimeConfig:
    """Read, validate and compile the rules file at ``path``."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text: {exc}") from exc
    return load_config_text(text, source=str(p), base_dir=p.parent)


def load_config_text(
    text: str, *, source: str = "<string>", base_dir: Path | None = None
) -> RuntimeConfig:
    """Validate and compile a rules document given as text."""
    try:
        doc = parse_rules(text, source)
    except YamlSyntaxError as exc:
        raise ConfigError(str(exc)) from exc
    if not isinstance(doc.data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    try:
        parsed = schema.ConfigFile.model_validate(doc.data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            parts = tuple(err["loc"])
            loc = render_path(parts) or "(top level)"
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown key"
            lines.append(f"{where(source, doc.position(parts))}: {loc}: {msg}")
        raise ConfigError("\n".join(lines)) from exc
    try:
        return compile_config(parsed, source=source, base_dir=base_dir or Path("."))
    except ConfigError as exc:
        raise ConfigError(locate(str(exc), source, doc)) from exc


def _spec(t: schema.TokenizerModel, base_dir: Path) -> TokenizerSpec:
    path = t.path
    if path is not None and not Path(path).is_absolute():
        path = str((base_dir / path).resolve())
    return TokenizerSpec(
        kind=t.kind,
        encoding=t.encoding,
        path=path,
        chars_per_token=t.chars_per_token,
        safety_factor=t.safety_factor,
        tokens_per_message=t.tokens_per_message,
        tokens_per_name=t.tokens_per_name,
        reply_priming_tokens=t.reply_priming_tokens,
        image_tokens=t.image_tokens,
    )


def _limits(
    entries: list[schema.LimitEntry],
    models: dict[str, str],
    where: str,
    *,
    currency: str = "USD",
    shadow: bool = False,
) -> list[Limit]:
    out: list[Limit] = []
    for i, e in enumerate(entries):
        if e.model != "*" and e.model not in models:
            raise ConfigError(f"{where}[{i}].model: unknown model {e.model!r}")
        canonical = "*" if e.model == "*" else models[e.model]
        made = _LimitMaker(e, canonical, shadow=e.shadow or shadow)
        if e.rpm is not None:
            out.append(made("rpm", e.rpm))
        if e.tpm is not None:
            out.append(made("tpm", e.tpm))
        if e.budget is not None:
            out.append(made("cost", round(e.budget * MICRO), unit=e.currency or currency))
        if e.weighted_tokens is not None and e.weights is not None:
            out.append(
                made("cost", e.weighted_tokens, unit="weighted", weights=_weights(e.weights))
            )
        if e.concurrency is not None:
            out.append(made("concurrency", e.concurrency))
    return out


#: Money budgets are counted in micro-units of their currency.
MICRO = 1_000_000


class _LimitMaker:
    """The :class:`Limit` values one rules entry compiles into."""

    def __init__(self, e: schema.LimitEntry, model: str, *, shadow: bool) -> None:
        self.e, self.model, self.shadow = e, model, shadow

    def __call__(
        self, metric: Metric, value: int, *, unit: str = "", weights: Rates | None = None
    ) -> Limit:
        e = self.e
        timed = metric != "concurrency"
        period = window_period(e.per, e.time_zone) if timed else None
        return Limit(
            metric,
            value,
            window_seconds(e.per) if timed else 0,
            self.model,
            e.scope,
            period=period,
            tz=e.time_zone,
            unit=unit,
            weights=weights,
            shadow=self.shadow,
            sliding=timed and e.window == "sliding",
        )


def _rates(f: schema.Weights | schema.Pricing, scale: int) -> Rates:
    """Per-kind figures times ``scale`` (cached input defaults to input, reasoning to output)."""
    cached = f.input if f.cached_input is None else f.cached_input
    reasoning = f.output if f.reasoning is None else f.reasoning
    return Rates(
        input=round(f.input * scale),
        cached_input=round(cached * scale),
        output=round(f.output * scale),
        reasoning=round(reasoning * scale),
        request=round(f.request * scale) if isinstance(f, schema.Pricing) else 0,
    )


def _weights(w: schema.Weights) -> Rates:
    """Weights as rates: weighted tokens per RATE_SCALE tokens."""
    return _rates(w, RATE_SCALE)


def _prices(p: schema.Pricing | None) -> Rates | None:
    """Per-million prices as rates: micro-units of the currency per million tokens."""
    return None if p is None else _rates(p, MICRO)


def _limit_errors(
    limits: list[Limit], where: str, cfg: schema.ConfigFile, canonical: dict[str, str]
) -> list[str]:
    """Budgets on models without a price; a longer period allowing less than a shorter one."""
    errors: list[str] = []
    priced = {name: m.pricing.currency if m.pricing else None for name, m in cfg.models.items()}
    for lim in limits:
        if lim.metric != "cost" or lim.unit == "weighted":
            continue
        names = list(cfg.models) if lim.model == "*" else [canonical[lim.model]]
        for name in names:
            if priced[name] is None:
                errors.append(
                    f"{where}: a {lim.unit} budget applies to model {name!r}, which has no "
                    f"pricing (add models.{name}.pricing)"
                )
            elif priced[name] != lim.unit:
                errors.append(
                    f"{where}: a {lim.unit} budget applies to model {name!r}, priced in "
                    f"{priced[name]}"
                )
        if lim.model == "*" and cfg.unknown_models.action == "estimate":
            up = cfg.unknown_models.pricing
            if up is None or up.currency != lim.unit:
                errors.append(
                    f"{where}: a {lim.unit} budget applies to unknown models (unknown_models: "
                    f"estimate), which need unknown_models.pricing in {lim.unit}"
                )
    for a in limits:
        for b in limits:
            same = (a.metric, a.unit, a.weights, a.model, a.scope, a.shadow) == (
                b.metric,
                b.unit,
                b.weights,
                b.model,
                b.scope,
                b.shadow,
            )
            if same and a.metric != "concurrency" and a.length_s > b.length_s and a.limit < b.limit:
                errors.append(
                    f"{where}: the {a.metric} limit per {a.period_name} ({a.limit}) is below "
                    f"the one per {b.period_name} ({b.limit}) for model {a.model!r}: the "
                    f"{b.period_name} limit could never be reached"
                )
    return errors


def _override_key(lim: Limit) -> tuple[object, ...]:
    """A tenant's own limit replaces the plan's limit with the same key."""
    return (
        lim.metric,
        lim.unit,
        lim.model,
        lim.scope,
        lim.window_s,
        lim.period,
        lim.shadow,
        lim.sliding,
    )


def _merge_charging(*levels: schema.ChargingModel) -> Charging:
    base = Charging()
    mode, streaming, every = base.mode, base.streaming, base.charge_every_tokens
    for lv in levels:
        mode = lv.mode or mode
        streaming = lv.streaming or streaming
        every = lv.charge_every_tokens or every
    return Charging(mode=mode, streaming=streaming, charge_every_tokens=every)


def compile_config(cfg: schema.ConfigFile, *, source: str, base_dir: Path) -> RuntimeConfig:
    """Resolve names, load tokenizers once, and precompute per-tenant limits."""
    errors: list[str] = []
    for kind, names in (("models", cfg.models), ("plans", cfg.plans), ("tenants", cfg.tenants)):
        for name in names:
            if not schema.IDENT.match(name):
                errors.append(
                    f"{source}: {kind}.{name}: names may use letters, digits, '.', '_' and '-'"
                )
    aliases: dict[str, str] = {}
    canonical: dict[str, str] = {}
    for name, m in cfg.models.items():
        canonical[name] = name
        for a in m.aliases:
            if a in cfg.models or a in aliases:
                errors.append(f"{source}: models.{name}.aliases: {a!r} is already a model or alias")
            aliases[a] = name
            canonical[a] = name
    try:
        specs = {name: _spec(m.tokenizer, base_dir) for name, m in cfg.models.items()}
        fallback_spec = _spec(cfg.unknown_models.tokenizer, base_dir)
        registry = TokenizerRegistry(specs, fallback=fallback_spec)
        counters = {name: registry.get(name) for name in cfg.models}
        fallback_counter = registry.get("\x00unknown-model")
        registry.warm()
    except (TokenizerLoadError, ValueError) as exc:
        raise ConfigError(f"{source}: models: {exc}") from exc
    models: dict[str, Model] = {}
    for name, m in cfg.models.items():
        counter = counters[name]
        assert counter is not None
        models[name] = Model(
            name=name,
            aliases=tuple(m.aliases),
            tokenizer=specs[name],
            counter=counter,
            max_output_tokens=m.max_output_tokens,
            max_input_tokens=m.max_input_tokens,
            delta_count=delta_counter(counter.count),
            bound_counter=upper_bound_counter(counter),
            prices=_prices(m.pricing),
            currency=m.pricing.currency if m.pricing else "",
            continuous_usage=m.stream_usage == "continuous",
            abandoned_tokens_per_second=m.abandoned_tokens_per_second,
            exact_non_streams=m.non_streams == "exact",
            exact_stream_interval=m.exact_stream_interval,
        )
    assert fallback_counter is not None
    unknown = Model(
        name=UNKNOWN_MODEL_NAME,
        aliases=(),
        tokenizer=fallback_spec,
        counter=fallback_counter,
        delta_count=delta_counter(fallback_counter.count),
        max_output_tokens=cfg.unknown_models.max_output_tokens,
        max_input_tokens=None,
        known=False,
        prices=_prices(cfg.unknown_models.pricing),
        currency=cfg.unknown_models.pricing.currency if cfg.unknown_models.pricing else "",
    )

    plans: dict[str, Plan] = {}
    fallbacks: dict[str, dict[str, str]] = {}
    for pname, p in cfg.plans.items():
        try:
            lims = _limits(
                p.limits,
                canonical,
                f"plans.{pname}.limits",
                currency=cfg.currency,
                shadow=p.shadow,
            )
        except ConfigError as exc:
            errors.append(f"{source}: {exc}")
            continue
        plans[pname] = Plan(pname, tuple(lims))
        for src, dst in p.fallback.items():
            where = f"{source}: plans.{pname}.fallback.{src}"
            if src not in canonical:
                errors.append(f"{where}: unknown model {src!r}")
            elif dst not in canonical:
                errors.append(f"{where}: unknown fallback model {dst!r}")
            elif canonical[src] == canonical[dst]:
                errors.append(f"{where}: a model cannot fall back to itself")
            else:
                fallbacks.setdefault(pname, {})[canonical[src]] = canonical[dst]
        errors += [
            f"{source}: {e}" for e in _limit_errors(lims, f"plans.{pname}.limits", cfg, canonical)
        ]

    lv = levels.compile_levels(
        cfg, lambda entries, where: _limits(entries, canonical, where, currency=cfg.currency)
    )
    errors += [f"{source}: {e}" for e in lv.errors]
    for (kind, name), level_lims in lv.own.items():
        where = f"{kind}s.{name}.limits"
        errors += [f"{source}: {e}" for e in _limit_errors(list(level_lims), where, cfg, canonical)]
    tenants: dict[str, Tenant] = {}
    keys: dict[str, ApiKey] = {}
    plaintext = 0
    for tid, t in cfg.tenants.items():
        if not t.keys and cfg.identity.sources == ["api_key"]:
            errors.append(
                f"{source}: tenants.{tid}.keys: a tenant needs at least one key while "
                "identity.sources is [api_key] (add jwt or header to identify it otherwise)"
            )
        if t.plan not in plans:
            if t.plan in cfg.plans:
                continue  # the plan itself had errors, reported above
            errors.append(f"{source}: tenants.{tid}.plan: unknown plan {t.plan!r}")
            continue
        try:
            own = _limits(t.limits, canonical, f"tenants.{tid}.limits", currency=cfg.currency)
        except ConfigError as exc:
            errors.append(f"{source}: {exc}")
            continue
        own_keys = {_override_key(lim) for lim in own}
        merged = [lim for lim in plans[t.plan].limits if _override_key(lim) not in own_keys] + own
        errors += [
            f"{source}: {e}" for e in _limit_errors(merged, f"tenants.{tid}.limits", cfg, canonical)
        ]
        lv_errors: list[str] = []
        org, team = levels.organisation_of_tenant(tid, t, lv, lv_errors)
        errors += [f"{source}: {e}" for e in lv_errors]
        members = {
            k.name: Membership(
                k.team, tuple(merged) + lv.limits(org, k.team), lv.strict_for(org, k.team)
            )
            for k in t.keys
            if k.team is not None and k.team != team
        }
        tenants[tid] = Tenant(
            tid,
            t.plan,
            tuple(merged) + lv.limits(org, team),
            organisation=org,
            team=team,
            strict=lv.strict_for(org, team),
            members=members,
        )
        for i, k in enumerate(t.keys):
            if k.plaintext is not None:
                plaintext += 1
                digest = hashlib.sha256(k.plaintext.encode()).hexdigest()
            else:
                assert k.sha256 is not None
                digest = k.sha256
            if digest in keys:
                errors.append(f"{source}: tenants.{tid}.keys[{i}]: this key is already assigned")
            keys[digest] = ApiKey(name=k.name, tenant=tid)
    for claim_value, tid in cfg.identity.jwt.tenant_map.items():
        if tid not in tenants:
            errors.append(
                f"{source}: identity.jwt.tenant_map.{claim_value}: unknown tenant {tid!r}"
            )
    longest = max(
        (
            lim.window_s
            for t in tenants.values()
            for lims in (t.limits, *(m.limits for m in t.members.values()))
            for lim in lims
        ),
        default=60,
    )
    if cfg.ledger_ttl_seconds < ledger_ttl_minimum(longest):
        errors.append(
            f"{source}: ledger_ttl_seconds: {cfg.ledger_ttl_seconds} is below the safe minimum "
            f"{ledger_ttl_minimum(longest)} (the longest window in use, {longest} s, capped at "
            f"3600, and never under {LEDGER_TTL_FLOOR_S})"
        )
    if errors:
        raise ConfigError("\n".join(errors))

    charging: dict[tuple[str, str], Charging] = {}
    default_charging: dict[str, Charging] = {}
    for pname, p in cfg.plans.items():
        default_charging[pname] = _merge_charging(cfg.charging, p.charging)
        for mname, m in cfg.models.items():
            charging[(pname, mname)] = _merge_charging(cfg.charging, m.charging, p.charging)
    default_charging.setdefault("", _merge_charging(cfg.charging))

    return RuntimeConfig(
        source=source,
        models=models,
        aliases=aliases,
        unknown_model_action=cfg.unknown_models.action,
        unknown_model_status=cfg.unknown_models.status,
        unknown_model=unknown,
        tenants=tenants,
        keys_by_digest=keys,
        charging=charging,
        default_charging=default_charging,
        metered_paths=frozenset(cfg.paths.metered),
        other_paths=cfg.paths.other,
        allowed_paths=tuple(cfg.paths.allow),
        public_paths=tuple(cfg.paths.public),
        max_body_bytes=cfg.requests.max_body_bytes,
        count_deadline_ms=cfg.requests.count_deadline_ms,
        admit_on_bound=cfg.requests.admit_on_bound,
        bound_headroom=cfg.requests.bound_headroom,
        bound_below=cfg.requests.bound_below,
        input_audit_every=cfg.requests.input_audit_every,
        max_tokens_ceiling=cfg.requests.max_tokens_ceiling,
        over_model_cap=cfg.requests.over_model_cap,
        max_n=cfg.requests.max_n,
        count_refused_requests=cfg.requests.count_refused_requests,
        force_include_usage=cfg.requests.force_include_usage,
        failure_mode=cfg.failure.mode,
        redis_timeout_ms=cfg.failure.timeout_ms,
        breaker_cooldown_ms=cfg.failure.breaker_cooldown_ms,
        reservation_lease_ms=cfg.failure.reservation_lease_seconds * 1000,
        identity=cfg.identity,
        end_users=cfg.end_users,
        organisations=lv.teams(),
        level_limits=dict(lv.own),
        ledger_ttl_seconds=cfg.ledger_ttl_seconds,
        plaintext_keys=plaintext,
        plan_failure_modes={n: p.failure_mode for n, p in cfg.plans.items() if p.failure_mode},
        fallbacks=fallbacks,
        plan_waits=wait_rules(cfg.plans),
        key_waits=key_wait_rules(cfg.tenants),
        max_waiters_per_replica=cfg.requests.max_waiters_per_replica,
    )


def key_digest(presented: str) -> str:
    """The SHA-256 hex digest under which a presented API key is looked up."""
    return hashlib.sha256(presented.encode()).hexdigest()
