"""envoyproxy/ratelimit's YAML config format, one file's text parsed and validated into a
:class:`~extproc.rls.config.Domain` (:func:`parse_text`).

One file per domain (like their ``RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/config``), each::

    domain: ai-gateway
    descriptors:
      - key: tenant                 # no value: one counter per distinct value
        descriptors:
          - key: metric
            value: rpm              # exact value; "*" anywhere in it is a wildcard
            rate_limit: {unit: minute, requests_per_unit: 60, name: rpm, replaces: [{name: x}]}
            shadow_mode: false      # counted and reported, never refuses
            detailed_metric: false  # metrics per distinct value instead of per rule

plus the keys they accept that change little (``quota_mode``, ``value_to_metric``,
``share_threshold``, ``metadata``), ``unit_multiplier`` in a ``rate_limit`` (the window is that
many units: ``{unit: minute, unit_multiplier: 5}`` counts per 5 minutes), and two of ours:
``ai_quota``, which makes a rule count in an ai-quota bucket (a tenant's RPM or TPM window, see
:class:`~extproc.rls.config.BucketLink`), and the domain's ``allow_limit_override`` (default false: a descriptor's
``limit`` override from Envoy is ignored and the descriptor matched against the rules).

The parser works on PyYAML's node tree, so every error names the file, the line and the path
(``descriptors[0].descriptors[1].rate_limit.unit``); it collects every error of a file rather
than stopping at the first (:class:`~extproc.rls.config.RlsConfigError` holds them all).
"""

from __future__ import annotations

import yaml

from extproc.rls.config import UNIT_SECONDS, BucketLink, Domain, Node, RlsConfigError, Rule

#: Units whose windows are the same as ai-quota's fixed windows (a bucket link needs one).
BUCKET_UNITS = ("second", "minute", "hour", "day")
MAX_REQUESTS_PER_UNIT = 2**32 - 1
#: The longest window a ``unit_multiplier`` may make (ten years of 365 days).
MAX_WINDOW_S = 10 * 365 * 86400

_DESCRIPTOR_KEYS = {
    "key",
    "value",
    "rate_limit",
    "descriptors",
    "shadow_mode",
    "quota_mode",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "metadata",
    "ai_quota",
}
_RATE_LIMIT_KEYS = {
    "unit",
    "requests_per_unit",
    "unit_multiplier",
    "unlimited",
    "name",
    "replaces",
}
_ROOT_KEYS = {"domain", "descriptors", "allow_limit_override"}
_LINK_KEYS = {"bucket", "tenant", "organisation", "team", "model"}


class _File:
    """Errors of one file, each with its line and path."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.errors: list[str] = []

    def error(self, node: yaml.Node | None, path: str, message: str) -> None:
        line = f"{node.start_mark.line + 1}" if node is not None else "1"
        where = f" {path}:" if path else ""
        self.errors.append(f"{self.name}:{line}:{where} {message}")


def _mapping(f: _File, node: yaml.Node, path: str, allowed: set[str]) -> dict[str, yaml.Node]:
    """A mapping node's items by key (unknown and duplicate keys are errors)."""
    if not isinstance(node, yaml.MappingNode):
        f.error(node, path, f"expected a mapping, found {_kind(node)}")
        return {}
    out: dict[str, yaml.Node] = {}
    for k, v in node.value:
        if not isinstance(k, yaml.ScalarNode) or k.tag != "tag:yaml.org,2002:str":
            f.error(k, path, f"a key must be a string, found {_kind(k)}")
            continue
        sub = f"{path}.{k.value}" if path else k.value
        if k.value not in allowed:
            f.error(k, sub, f"unknown key '{k.value}' (allowed: {', '.join(sorted(allowed))})")
            continue
        if k.value in out:
            f.error(k, sub, "duplicate key")
            continue
        out[k.value] = v
    return out


def _kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    tag = node.tag.rsplit(":", 1)[-1]
    return f"{tag} {node.value!r}" if tag != "null" else "nothing"


def _string(f: _File, node: yaml.Node, path: str, *, scalar_ok: bool = False) -> str | None:
    if isinstance(node, yaml.ScalarNode):
        if node.tag == "tag:yaml.org,2002:str":
            return str(node.value)
        if scalar_ok and node.tag in (
            "tag:yaml.org,2002:int",
            "tag:yaml.org,2002:float",
            "tag:yaml.org,2002:bool",
        ):
            return str(node.value)  # `value: 200`: their loader reads it as the string "200"
    f.error(node, path, f"expected a string, found {_kind(node)}")
    return None


def _bool(f: _File, node: yaml.Node | None, path: str) -> bool:
    if node is None:
        return False
    if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:bool":
        return bool(yaml.safe_load(node.value))
    f.error(node, path, f"expected true or false, found {_kind(node)}")
    return False


def _int(f: _File, node: yaml.Node, path: str) -> int | None:
    if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:int":
        value = int(yaml.safe_load(node.value))
        if 0 <= value <= MAX_REQUESTS_PER_UNIT:
            return value
        f.error(node, path, f"must be between 0 and {MAX_REQUESTS_PER_UNIT}, found {value}")
        return None
    f.error(node, path, f"expected a whole number, found {_kind(node)}")
    return None


def _sequence(f: _File, node: yaml.Node, path: str) -> list[yaml.Node]:
    if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null":
        return []
    if not isinstance(node, yaml.SequenceNode):
        f.error(node, path, f"expected a list, found {_kind(node)}")
        return []
    return list(node.value)


def parse_text(text: str, name: str) -> Domain:
    """One file's domain, or :class:`RlsConfigError` with every error of the file."""
    f = _File(name)
    try:
        doc = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"{mark.line + 1}" if mark is not None else "1"
        problem = getattr(exc, "problem", None) or str(exc)
        raise RlsConfigError([f"{name}:{line}: not valid YAML: {problem}"]) from None
    if doc is None:
        raise RlsConfigError([f"{name}:1: the file is empty (expected domain and descriptors)"])
    items = _mapping(f, doc, "", _ROOT_KEYS)
    domain = ""
    if "domain" in items:
        domain = _string(f, items["domain"], "domain") or ""
        if not domain and not f.errors:
            f.error(items["domain"], "domain", "the domain must not be empty")
    elif isinstance(doc, yaml.MappingNode):
        f.error(doc, "", "missing key 'domain'")
    allow_override = _bool(f, items.get("allow_limit_override"), "allow_limit_override")
    root = Node("", "", None)
    if "descriptors" in items:
        _descriptors(f, items["descriptors"], "descriptors", root, stat=domain, keys=[])
    if f.errors:
        raise RlsConfigError(f.errors)
    return Domain(domain, root, name, allow_override)


def _descriptors(
    f: _File, node: yaml.Node, path: str, parent: Node, *, stat: str, keys: list[str]
) -> None:
    for i, item in enumerate(_sequence(f, node, path)):
        here = f"{path}[{i}]"
        d = _mapping(f, item, here, _DESCRIPTOR_KEYS)
        if not d and not isinstance(item, yaml.MappingNode):
            continue
        key = _string(f, d["key"], f"{here}.key") if "key" in d else None
        if "key" not in d:
            f.error(item, here, "missing key 'key'")
        elif key == "":
            f.error(d["key"], f"{here}.key", "the key must not be empty")
        elif key is not None and "*" in key:
            f.error(d["key"], f"{here}.key", "a wildcard '*' is allowed in a value, not in a key")
        value = ""
        if "value" in d:
            value = _string(f, d["value"], f"{here}.value", scalar_ok=True) or ""
        shadow = _bool(f, d.get("shadow_mode"), f"{here}.shadow_mode")
        quota = _bool(f, d.get("quota_mode"), f"{here}.quota_mode")
        detailed = _bool(f, d.get("detailed_metric"), f"{here}.detailed_metric")
        _bool(f, d.get("value_to_metric"), f"{here}.value_to_metric")  # metric names only
        share = _bool(f, d.get("share_threshold"), f"{here}.share_threshold")
        if share and "*" not in value:
            f.error(
                d["share_threshold"],
                f"{here}.share_threshold",
                "share_threshold needs a wildcard value (one containing '*')",
            )
        metadata = None
        if "metadata" in d:
            meta = yaml.safe_load(yaml.serialize(d["metadata"]))
            if not isinstance(meta, dict):
                f.error(d["metadata"], f"{here}.metadata", "expected a mapping")
            else:
                metadata = meta
        if not key:
            continue
        path_keys = [*keys, key]
        final = f"{key}_{value}" if value else key
        stat_key = f"{stat}.{final}"
        rule = None
        if "rate_limit" in d:
            rule = _rate_limit(
                f,
                d["rate_limit"],
                f"{here}.rate_limit",
                stat=stat_key,
                shadow=shadow,
                quota=quota,
                detailed=detailed,
            )
        link = None
        if "ai_quota" in d:
            link = _link(f, d["ai_quota"], f"{here}.ai_quota", path_keys, rule)
        if rule is not None:
            rule = Rule(
                path=rule.path,
                unit=rule.unit,
                requests_per_unit=rule.requests_per_unit,
                unlimited=rule.unlimited,
                unit_multiplier=rule.unit_multiplier,
                name=rule.name,
                replaces=rule.replaces,
                shadow_mode=shadow,
                quota_mode=quota,
                detailed_metric=detailed,
                metadata=metadata,
                link=link,
            )
        child = Node(key, value, rule, share_threshold=share)
        ident = (key, value)
        if ident in parent.children or any(
            w[0] == key and "*".join(w[1]) == value for w in parent.wildcards
        ):
            f.error(item, here, f"duplicate descriptor '{stat_key}' (same key and value twice)")
            continue
        if "*" in value:
            parent.wildcards.append((key, tuple(value.split("*")), child))
        else:
            parent.children[ident] = child
        if "descriptors" in d:
            _descriptors(
                f, d["descriptors"], f"{here}.descriptors", child, stat=stat_key, keys=path_keys
            )


def _rate_limit(
    f: _File,
    node: yaml.Node,
    path: str,
    *,
    stat: str,
    shadow: bool,
    quota: bool,
    detailed: bool,
) -> Rule | None:
    r = _mapping(f, node, path, _RATE_LIMIT_KEYS)
    if not r and not isinstance(node, yaml.MappingNode):
        return None
    unlimited = _bool(f, r.get("unlimited"), f"{path}.unlimited")
    unit = ""
    if "unit" in r:
        raw = _string(f, r["unit"], f"{path}.unit")
        if raw is not None:
            unit = raw.lower()
            if unit not in UNIT_SECONDS:
                f.error(
                    r["unit"],
                    f"{path}.unit",
                    f"invalid unit '{raw}' (one of: {', '.join(UNIT_SECONDS)})",
                )
                return None
            if unlimited:
                f.error(r["unit"], f"{path}.unit", "an unlimited rate_limit takes no unit")
    elif not unlimited:
        f.error(node, path, "missing key 'unit' (or unlimited: true)")
    rpu = 0
    if "requests_per_unit" in r:
        rpu = _int(f, r["requests_per_unit"], f"{path}.requests_per_unit") or 0
    elif not unlimited:
        f.error(node, path, "missing key 'requests_per_unit'")
    multiplier = 1
    if "unit_multiplier" in r:
        got = _int(f, r["unit_multiplier"], f"{path}.unit_multiplier")
        if unlimited:
            f.error(
                r["unit_multiplier"],
                f"{path}.unit_multiplier",
                "an unlimited rate_limit takes no unit_multiplier",
            )
        elif got is not None and got < 1:
            f.error(r["unit_multiplier"], f"{path}.unit_multiplier", "must be at least 1")
        elif got is not None and unit in UNIT_SECONDS and UNIT_SECONDS[unit] * got > MAX_WINDOW_S:
            f.error(
                r["unit_multiplier"],
                f"{path}.unit_multiplier",
                f"{got} {unit}s is longer than the longest window ({MAX_WINDOW_S // 86400} days)",
            )
        elif got is not None:
            multiplier = got
    name = ""
    if "name" in r:
        name = _string(f, r["name"], f"{path}.name") or ""
    replaces: list[str] = []
    for j, rep in enumerate(
        _sequence(f, r["replaces"], f"{path}.replaces") if "replaces" in r else []
    ):
        rp = _mapping(f, rep, f"{path}.replaces[{j}]", {"name"})
        rname = _string(f, rp["name"], f"{path}.replaces[{j}].name") if "name" in rp else ""
        if not rname:
            f.error(rep, f"{path}.replaces[{j}]", "a replaces entry needs a non-empty name")
        elif rname == name:
            f.error(rep, f"{path}.replaces[{j}]", "a rule cannot replace itself")
        else:
            replaces.append(rname)
    return Rule(
        path=stat,
        unit="" if unlimited else unit,
        requests_per_unit=rpu,
        unlimited=unlimited,
        unit_multiplier=multiplier,
        name=name,
        replaces=tuple(replaces),
        shadow_mode=shadow,
        quota_mode=quota,
        detailed_metric=detailed,
    )


def _link(
    f: _File, node: yaml.Node, path: str, keys: list[str], rule: Rule | None
) -> BucketLink | None:
    m = _mapping(f, node, path, _LINK_KEYS)
    if not m:
        if isinstance(node, yaml.MappingNode):
            f.error(node, path, "missing key 'bucket'")
        return None
    if rule is None:
        f.error(node, path, "ai_quota needs a rate_limit on the same descriptor")
        return None
    if rule.unlimited or rule.unit not in BUCKET_UNITS:
        f.error(
            node,
            path,
            f"an ai-quota bucket counts in fixed windows of {', '.join(BUCKET_UNITS)}; "
            f"this rule's unit is '{rule.unit or 'unlimited'}'",
        )
    elif rule.unit_multiplier != 1:
        f.error(
            node,
            path,
            "an ai-quota bucket counts in windows of one unit; this rule has unit_multiplier "
            f"{rule.unit_multiplier}",
        )
    bucket = _string(f, m["bucket"], f"{path}.bucket") if "bucket" in m else None
    if "bucket" not in m:
        f.error(node, path, "missing key 'bucket' (rpm or tpm)")
    elif bucket not in ("rpm", "tpm"):
        f.error(m["bucket"], f"{path}.bucket", f"bucket must be rpm or tpm, found {bucket!r}")
    named = [k for k in ("tenant", "organisation", "team") if k in m]
    level = named[0] if len(named) == 1 else "tenant"
    tenant = _string(f, m[level], f"{path}.{level}") if level in m else None
    if not named:
        f.error(
            node,
            path,
            "missing key 'tenant' (the descriptor key whose value is the tenant; or "
            "'organisation' / 'team' for a level's bucket)",
        )
    elif len(named) > 1:
        f.error(node, path, f"name one of tenant, organisation or team, not {', '.join(named)}")
    elif tenant is not None and tenant not in keys:
        f.error(
            m[level],
            f"{path}.{level}",
            f"'{tenant}' is not a key on this descriptor's path ({' -> '.join(keys)})",
        )
    model = "*"
    if "model" in m:
        model = _string(f, m["model"], f"{path}.model") or "*"
        if model != "*" and model not in keys:
            f.error(
                m["model"],
                f"{path}.model",
                f"'{model}' is not a key on this descriptor's path ({' -> '.join(keys)}); "
                "use '*' for the tenant-wide bucket",
            )
    if bucket in ("rpm", "tpm") and tenant and tenant in keys and len(named) == 1:
        model_index = keys.index(model) if model != "*" and model in keys else -1
        return BucketLink(
            bucket,  # type: ignore[arg-type]
            tenant,
            model if model_index >= 0 else "*",
            keys.index(tenant),  # the first entry of that key on the path
            model_index,
            level,
        )
    return None
