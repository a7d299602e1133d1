"""The rules file and the store compiled together into the :class:`RuntimeConfig` a replica
runs on (the merge itself is :func:`extproc.admin.state.merge`)."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from extproc.admin.state import StoredTenant, StoreState, effective_version, merge
from extproc.config import schema
from extproc.config.load import ConfigError, compile_config, load_config, load_config_text
from extproc.config.runtime import RuntimeConfig


@dataclass(frozen=True, slots=True)
class FileRules:
    """The rules file as loaded: compiled alone, and as a document the store is merged into."""

    source: str
    base_dir: Path
    version: str
    config: RuntimeConfig
    document: schema.ConfigFile


def read_file_rules(path: str, version_of: Callable[[str], str]) -> FileRules:
    """Load and validate the rules file (:class:`ConfigError` when it is not valid);
    ``version_of`` hashes its text (``extproc.app.config_version``)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        load_config(path)  # raises the usual ConfigError
        raise
    return file_rules_from_text(text, source=str(p), base_dir=p.parent, version_of=version_of)


def file_rules_from_text(
    text: str, *, source: str, base_dir: Path, version_of: Callable[[str], str]
) -> FileRules:
    """:func:`read_file_rules` for a document given as text."""
    cfg = load_config_text(text, source=source, base_dir=base_dir)
    # valid: load_config_text accepted it (duplicate keys, positions and all)
    document = schema.ConfigFile.model_validate(yaml.safe_load(text))
    return FileRules(source, base_dir, version_of(text), cfg, document)


@dataclass(frozen=True, slots=True)
class Effective:
    """The rules in force on a replica."""

    config: RuntimeConfig
    version: str
    store_version: int
    skipped: tuple[str, ...] = ()


def effective(rules: FileRules, state: StoreState, now: float) -> Effective:
    """Compile the file with the store merged in; :class:`ConfigError` when the merge does
    not compile (the caller keeps the rules it runs on)."""
    version = effective_version(rules.version, state, now)
    if version == rules.version:
        return Effective(rules.config, version, state.version)
    merged = merge(rules.document, state, now)
    cfg = compile_config(merged.document, source=rules.source, base_dir=rules.base_dir)
    return Effective(cfg, version, state.version, merged.skipped)


def tenant_errors(rules: FileRules, tenant_id: str, tenant: StoredTenant) -> list[str]:
    """Why the rules file would refuse ``tenant`` under this id (empty: it would not): the
    plan must be one of the file's, the limits must compile against its models and prices."""
    if tenant.plan not in rules.document.plans:
        known = ", ".join(sorted(rules.document.plans))
        return [f"unknown plan {tenant.plan!r} (the rules file defines: {known})"]
    # a throw-away key: a tenant needs one to compile when API keys are the only identity
    probe = hashlib.sha256(secrets.token_bytes(32)).hexdigest()
    entry = schema.TenantEntry(
        plan=tenant.plan,
        keys=[schema.KeyEntry(name="admin-check", sha256=probe)],
        limits=list(tenant.limits),
    )
    doc = rules.document.model_copy(
        update={"tenants": {**rules.document.tenants, tenant_id: entry}}
    )
    try:
        compile_config(doc, source="admin", base_dir=rules.base_dir)
    except ConfigError as exc:
        return [line.removeprefix("admin: ") for line in str(exc).splitlines()]
    return []
