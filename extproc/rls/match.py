"""The RLS decision logic, sans-IO: descriptors -> rules -> counter keys -> statuses.

Matching follows envoyproxy/ratelimit: the entries of a descriptor walk the domain's tree one
level each; at each level an exact ``key``/``value`` child wins, then the first wildcard child
(in declaration order) whose value pattern matches, then the value-less ``key`` child.  A rule
applies only when the *last* entry lands on a node with a ``rate_limit``; a walk that runs out
of tree, or an entry that matches nothing, means no limit.  Counters are per distinct entry
values (a value-less key or a wildcard counts each value apart), except under
``share_threshold``, where every value a wildcard matches shares one counter.

Windows are fixed and epoch-aligned (``window = now // unit``; a month is 30 days, a year
365), as theirs, so a fleet can move from one service to the other mid-window; a rule's
``unit_multiplier`` makes the window that many units (``now // (unit * multiplier)``).

What a caller sends is bounded before anything is looked up (:class:`Caps`: descriptors per
request, entries per descriptor, key and value length, ``hits_addend``; each refused with
:class:`RequestError` naming the cap), and only configured domains count: an unknown domain is
answered OK without a counter, and a descriptor's ``limit`` override applies only in a domain
that allows it (``allow_limit_override``), otherwise it is matched like any descriptor.

Nothing here does IO: :func:`plan` turns a request into counter operations, the caller runs
them (one Lua call) and :func:`decide` turns the counters' values into the answer.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from functools import lru_cache
from typing import Literal
from urllib.parse import quote as _quote

from extproc.core.keys import EXPIRY_SLACK_MS, bucket_key, slot_id
from extproc.core.rules import Limit
from extproc.rls.config import Domain, Node, RlsConfig, Rule, valid_tenant

MAX_UINT32 = 2**32 - 1
MAX_HITS = 2**32
#: The metric label (``rule``) of every descriptor counted by a ``limit`` override: its
#: entries are the caller's text, so they never become a label value.
OVERRIDE_RULE = "override"


@dataclass(frozen=True, slots=True)
class Caps:
    """What one request may carry (a caller's descriptors become Redis keys and work): each
    exceeded cap is refused with :class:`RequestError` naming it (``AIQ_RLS_MAX_*``)."""

    descriptors: int = 32  # descriptors per request
    entries: int = 16  # entries per descriptor
    key_length: int = 128  # characters of an entry's key (and of the domain)
    value_length: int = 512  # characters of an entry's value
    hits_addend: int = 1_000_000  # a request's or a descriptor's hits_addend

    def check(self, domain: str, descriptors: Sequence[Descriptor], hits_addend: int) -> None:
        """:class:`RequestError` naming the first cap the request exceeds."""
        if len(domain) > self.key_length:
            raise RequestError(
                f"the domain is {len(domain)} characters, more than the cap "
                f"AIQ_RLS_MAX_KEY_LENGTH={self.key_length}"
            )
        if len(descriptors) > self.descriptors:
            raise RequestError(
                f"{len(descriptors)} descriptors in one request, more than the cap "
                f"AIQ_RLS_MAX_DESCRIPTORS={self.descriptors}"
            )
        if hits_addend > self.hits_addend:
            raise RequestError(
                f"hits_addend {hits_addend} is more than the cap "
                f"AIQ_RLS_MAX_HITS_ADDEND={self.hits_addend}"
            )
        for i, d in enumerate(descriptors):
            if len(d.entries) > self.entries:
                raise RequestError(
                    f"descriptor {i} has {len(d.entries)} entries, more than the cap "
                    f"AIQ_RLS_MAX_ENTRIES={self.entries}"
                )
            if d.hits_addend is not None and d.hits_addend > self.hits_addend:
                raise RequestError(
                    f"descriptor {i}'s hits_addend {d.hits_addend} is more than the cap "
                    f"AIQ_RLS_MAX_HITS_ADDEND={self.hits_addend}"
                )
            for k, v in d.entries:
                if len(k) > self.key_length:
                    raise RequestError(
                        f"descriptor {i} has a key of {len(k)} characters, more than the cap "
                        f"AIQ_RLS_MAX_KEY_LENGTH={self.key_length}"
                    )
                if len(v) > self.value_length:
                    raise RequestError(
                        f"descriptor {i} has a value of {len(v)} characters, more than the cap "
                        f"AIQ_RLS_MAX_VALUE_LENGTH={self.value_length}"
                    )


#: The caps when none are given.
DEFAULT_CAPS = Caps()


class Code(IntEnum):
    """``RateLimitResponse.Code`` values."""

    UNKNOWN = 0
    OK = 1
    OVER_LIMIT = 2


class RequestError(ValueError):
    """A request the service refuses to evaluate (answered ``INVALID_ARGUMENT``)."""


@dataclass(frozen=True, slots=True)
class Descriptor:
    """One ``RateLimitDescriptor``: its entries, its own ``hits_addend`` (None: unset) and a
    limit override from Envoy's route config (``(unit, requests_per_unit)``)."""

    entries: tuple[tuple[str, str], ...]
    hits_addend: int | None = None
    override: tuple[str, int] | None = None


@dataclass(frozen=True, slots=True)
class Found:
    """The rule a descriptor matched, and the values its counter key uses."""

    rule: Rule
    key_values: tuple[str, ...]  # per entry: the value, or a shared wildcard pattern


def _wild(parts: tuple[str, ...], value: str) -> bool:
    """Whether ``value`` matches a value pattern split on ``*`` (each ``*``: any run)."""
    if len(parts) == 1:
        return parts[0] == value
    first, last = parts[0], parts[-1]
    if len(value) < sum(len(p) for p in parts):
        return False
    if not value.startswith(first) or not value.endswith(last):
        return False
    rest = value[len(first) : len(value) - len(last)]
    for mid in parts[1:-1]:
        idx = rest.find(mid)
        if idx < 0:
            return False
        rest = rest[idx + len(mid) :]
    return True


def _child(node: Node, key: str, value: str) -> tuple[Node | None, str]:
    """The child an entry moves to, and the value its counter key uses."""
    exact = node.children.get((key, value))
    if exact is not None:
        return exact, value
    for wkey, parts, child in node.wildcards:
        if wkey == key and _wild(parts, value):
            return child, ("*".join(parts) if child.share_threshold else value)
    return node.children.get((key, "")), value


def find(domain: Domain, entries: Sequence[tuple[str, str]]) -> Found | None:
    """The rule that applies to these entries, or None (no limit)."""
    node = domain.root
    values: list[str] = []
    for i, (key, value) in enumerate(entries):
        nxt, used = _child(node, key, value)
        if nxt is None:
            return None
        values.append(used)
        if i == len(entries) - 1:
            return Found(nxt.rule, tuple(values)) if nxt.rule is not None else None
        if not nxt.children and not nxt.wildcards:
            return None  # more entries than the tree is deep
        node = nxt
    return None


# -- a request -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Counted:
    """A descriptor whose counter Redis checks (and adds ``hits`` to, when admitted)."""

    key: str
    hits: int
    limit: int
    expire_at_ms: int
    reset_s: int
    mode: int  # 0 shadow (never refuses), 1 enforced, 2 quota mode


@dataclass(frozen=True, slots=True)
class Item:
    """What one descriptor of the request needs: ``rule`` None = no limit applies."""

    descriptor: Descriptor
    rule: Rule | None
    hits: int
    unlimited: bool = False
    counted: Counted | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    """A request's descriptors, in order, and the counters to check in one call."""

    domain: str
    items: tuple[Item, ...]
    global_shadow: bool = False
    known_domain: bool = True  # False: not in the config (answered OK, nothing counted)
    overrides_ignored: int = 0  # limit overrides in a domain that does not allow them

    @property
    def counted(self) -> list[Counted]:
        """The counters, in descriptor order (a descriptor with none is left out)."""
        return [i.counted for i in self.items if i.counted is not None]


@lru_cache(maxsize=8192)
def _q(text: str) -> str:
    """``text`` percent-encoded for a key (every byte but letters, digits and ``_.-~``)."""
    return _quote(text, safe="")


def plan(
    config: RlsConfig,
    domain: str,
    descriptors: Sequence[Descriptor],
    hits_addend: int,
    now_ms: int,
    *,
    prefix: str = "aiq",
    global_shadow: bool = False,
    caps: Caps = DEFAULT_CAPS,
    tenants: Container[str] | None = None,
    models: Container[str] | None = None,
    organisations: Mapping[str, tuple[str, ...]] | None = None,
) -> Plan:
    """Check the caps, match every descriptor, apply ``replaces`` and build the counter keys.

    ``tenants`` and ``models`` (None: any) are the ai-quota tenants and canonical models an
    ``ai_quota`` link may charge (a mapping of tenants: their slot ids, for tenants inside an
    organisation); ``organisations`` (organisation -> its teams; None: none) the levels one
    may; a value outside them is counted by the rule on its own key, as a rule without the
    link."""
    if not domain:
        raise RequestError("rate limit domain must not be empty")
    if not descriptors:
        raise RequestError("rate limit descriptor list must not be empty")
    caps.check(domain, descriptors, hits_addend)
    dom = config.domains.get(domain)
    if dom is None:
        # as envoyproxy/ratelimit: an unknown domain has no limit, whatever the descriptors
        # carry (their limit overrides included); nothing is counted or stored
        none = tuple(Item(d, None, 0) for d in descriptors)
        return Plan(domain, none, global_shadow, known_domain=False)
    found: list[Found | None] = []
    ignored = 0
    for d in descriptors:
        if d.override is not None and dom.allow_override:
            unit, rpu = d.override
            found.append(Found(Rule(OVERRIDE_RULE, unit, rpu), tuple(v for _, v in d.entries)))
            continue
        ignored += d.override is not None
        found.append(find(dom, d.entries))
    replaced = {name for f in found if f is not None for name in f.rule.replaces}
    items = []
    for d, f in zip(descriptors, found, strict=True):
        hits = d.hits_addend if d.hits_addend is not None else max(1, hits_addend)
        # past every limit (uint32) anyway; keeps a shadow counter from overflowing Redis's
        # 64-bit integers (an INCRBY error would count against the breaker)
        hits = min(hits, MAX_HITS)
        if f is None or (f.rule.name and f.rule.name in replaced):
            items.append(Item(d, None, hits))
            continue
        rule = f.rule
        if rule.unlimited:
            items.append(Item(d, rule, hits, unlimited=True))
            continue
        items.append(
            Item(
                d,
                rule,
                hits,
                counted=_counted(
                    domain,
                    d,
                    f,
                    hits=hits,
                    now_ms=now_ms,
                    prefix=prefix,
                    tenants=tenants,
                    models=models,
                    organisations=organisations,
                ),
            )
        )
    if global_shadow:
        items = [
            Item(i.descriptor, i.rule, i.hits, i.unlimited, _as_shadow(i.counted)) for i in items
        ]
    return Plan(domain, tuple(items), global_shadow, overrides_ignored=ignored)


def _as_shadow(c: Counted | None) -> Counted | None:
    if c is None:
        return None
    return Counted(c.key, c.hits, c.limit, c.expire_at_ms, c.reset_s, 0)


def window(unit_s: int, now_ms: int) -> tuple[int, int]:
    """(index, end in unix ms) of the epoch-aligned window of ``unit_s`` seconds."""
    w = unit_s * 1000
    idx = now_ms // w
    return idx, (idx + 1) * w


def reset_seconds(unit_s: int, now_ms: int) -> int:
    """Whole seconds until the window ends, as theirs (``unit - now % unit``)."""
    now_s = now_ms // 1000
    return unit_s - now_s % unit_s


def _counted(
    domain: str,
    d: Descriptor,
    f: Found,
    *,
    hits: int,
    now_ms: int,
    prefix: str,
    tenants: Container[str] | None = None,
    models: Container[str] | None = None,
    organisations: Mapping[str, tuple[str, ...]] | None = None,
) -> Counted:
    rule = f.rule
    unit_s = rule.window_s
    idx, end = window(unit_s, now_ms)
    mode = 0 if rule.shadow_mode else (2 if rule.quota_mode else 1)
    reset = reset_seconds(unit_s, now_ms)
    link = _linked(rule, d, tenants, models)
    level = rule.link.level if rule.link is not None else "tenant"
    slot = _level_slot(level, link[0], tenants, organisations) if link is not None else None
    if link is not None and slot is not None:
        ident, model, bucket = link
        if level == "tenant":
            lim = Limit(bucket, rule.requests_per_unit, unit_s, model, "tenant")
        else:
            lim = Limit(bucket, rule.requests_per_unit, unit_s, model, level, owner=ident)
        key = bucket_key(prefix, slot, "", lim, idx)
    else:
        first = (f.key_values[0] or d.entries[0][0]) if d.entries else domain
        tag = _q(first)
        parts = "|".join(
            f"{_q(k)}={_q(v)}" for (k, _), v in zip(d.entries, f.key_values, strict=True)
        )
        key = f"{prefix}:{{{tag}}}:rls:{_q(domain)}:{parts}:{unit_s}:{idx}"
    return Counted(key, hits, rule.requests_per_unit, end + EXPIRY_SLACK_MS, reset, mode)


def _level_slot(
    level: str,
    ident: str,
    tenants: Container[str] | None,
    organisations: Mapping[str, tuple[str, ...]] | None,
) -> str | None:
    """The slot id (:func:`extproc.core.keys.slot_id`) a linked level's keys are named by; None
    for an organisation or team the running rules do not have (counted on the rule's own key)."""
    if level == "tenant":
        found = tenants.get(ident) if isinstance(tenants, Mapping) else None
        return str(getattr(found, "slot", ident))
    for org, teams in (organisations or {}).items():
        if (level == "organisation" and ident == org) or (level == "team" and ident in teams):
            return slot_id("", org)
    return None


def _linked(
    rule: Rule,
    d: Descriptor,
    tenants: Container[str] | None,
    models: Container[str] | None,
) -> tuple[str, str, Literal["rpm", "tpm"]] | None:
    """(tenant, model, bucket) of the ai-quota bucket a linked rule charges, or None: no link,
    or the values name no tenant (model) of the rules, and the rule counts on its own key.

    The tenant is the value of the entry the tree matched at the link's level (a descriptor
    matches a rule only with exactly as many entries as the rule's path is deep), so a caller
    names only a tenant the config's descriptor lets through at that level."""
    link = rule.link
    if link is None or link.tenant_index >= len(d.entries):
        return None
    tenant = d.entries[link.tenant_index][1]
    if not valid_tenant(tenant):
        raise RequestError(
            f"entry '{link.tenant_key}' must name a tenant (letters, digits, . _ : -; "
            f"at most 128), found {tenant[:140]!r}"
        )
    model = "*"
    if 0 <= link.model_index < len(d.entries):
        model = d.entries[link.model_index][1] or "*"
    if link.level == "tenant" and tenants is not None and tenant not in tenants:
        return None
    if model != "*" and models is not None and model not in models:
        return None
    return tenant, model, link.bucket


# -- the answer ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Status:
    """One ``DescriptorStatus``: ``rule`` None means no ``current_limit``."""

    code: Code
    rule: Rule | None = None
    limit_remaining: int = 0
    reset_s: int = 0


@dataclass(slots=True)
class RuleStats:
    """What one descriptor adds to its rule's counters (their meanings)."""

    rule: Rule
    name: str  # the metric's rule label: the rule's path, or the values' (detailed_metric)
    total_hits: int = 0
    over_limit: int = 0
    near_limit: int = 0
    within_limit: int = 0
    shadow_mode: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer to a request."""

    overall: Code
    statuses: tuple[Status, ...]
    headers: tuple[tuple[str, str], ...] = ()
    stats: tuple[RuleStats, ...] = field(default=())
    global_shadow_hit: bool = False


def decide(
    p: Plan,
    before: Sequence[int],
    admitted: bool,
    *,
    near_ratio: float = 0.8,
    headers: tuple[str, str, str] | None = None,
) -> Decision:
    """Statuses and stats from each counter's value before this request (``before``, one per
    :attr:`Plan.counted`, in order; a descriptor repeated in a request sees the earlier one's
    hits) and whether the call counted the hits (``admitted``)."""
    statuses: list[Status] = []
    stats: list[RuleStats] = []
    values = iter(before)
    failed = quota_total = quota_failed = 0
    pick: Status | None = None
    for item in p.items:
        if item.rule is None:
            statuses.append(Status(Code.OK))
            continue
        if item.unlimited or item.counted is None:
            statuses.append(Status(Code.OK, None, MAX_UINT32))
            continue
        c = item.counted
        prior = int(next(values))
        after = prior + c.hits
        limit = c.limit
        st = RuleStats(item.rule, _metric_name(p.domain, item))
        st.total_hits = c.hits
        near = int(limit * near_ratio)
        over = after > limit
        if over:
            if prior >= limit:
                st.over_limit = c.hits
            else:
                st.over_limit = after - limit
                st.near_limit = limit - max(near, prior)
            if item.rule.shadow_mode:
                st.shadow_mode = c.hits if prior >= limit else after - limit
            code = Code.OK if item.rule.shadow_mode else Code.OVER_LIMIT
            status = Status(code, item.rule, 0, c.reset_s)
        else:
            if after > near:
                st.near_limit = c.hits if prior >= near else after - near
            st.within_limit = c.hits
            left = limit - after if admitted else limit - prior
            status = Status(Code.OK, item.rule, max(0, min(MAX_UINT32, left)), c.reset_s)
        stats.append(st)
        statuses.append(status)
        if item.rule.quota_mode and not item.rule.shadow_mode:
            quota_total += 1
            quota_failed += status.code is Code.OVER_LIMIT
        elif status.code is Code.OVER_LIMIT:
            failed += 1
        if status.code is Code.OVER_LIMIT and not item.rule.quota_mode:
            pick = status  # an over-limit descriptor is the one the headers describe
        elif pick is None or (
            pick.code is not Code.OVER_LIMIT and status.limit_remaining < pick.limit_remaining
        ):
            pick = status
    overall = Code.OK
    if failed or (quota_total and quota_total == quota_failed):
        overall = Code.OVER_LIMIT
    shadow_hit = p.global_shadow and overall is Code.OVER_LIMIT
    if shadow_hit:
        overall = Code.OK  # global shadow mode: reported and counted, never refused
    out_headers: tuple[tuple[str, str], ...] = ()
    if headers is not None and pick is not None and pick.rule is not None:
        h_limit, h_remaining, h_reset = headers
        out_headers = (
            (h_limit, str(pick.rule.requests_per_unit)),
            (h_remaining, str(pick.limit_remaining)),
            (h_reset, str(pick.reset_s)),
        )
    return Decision(overall, tuple(statuses), out_headers, tuple(stats), shadow_hit)


def _metric_name(domain: str, item: Item) -> str:
    rule = item.rule
    assert rule is not None
    if rule.detailed_metric:
        return domain + "." + ".".join(f"{k}_{v}" if v else k for k, v in item.descriptor.entries)
    return rule.path


def fail_open(p: Plan) -> Decision:
    """Redis is unavailable and the failure mode allows: every descriptor OK."""
    return Decision(Code.OK, tuple(Status(Code.OK) for _ in p.items))


def fail_closed(p: Plan) -> Decision:
    """Redis is unavailable and the failure mode denies: every counted descriptor over."""
    statuses = []
    for item in p.items:
        if item.counted is not None and item.rule is not None:
            statuses.append(Status(Code.OVER_LIMIT, item.rule, 0, item.counted.reset_s))
        elif item.unlimited:
            statuses.append(Status(Code.OK, None, MAX_UINT32))
        else:
            statuses.append(Status(Code.OK))
    refused = any(s.code is Code.OVER_LIMIT for s in statuses)
    return Decision(Code.OVER_LIMIT if refused else Code.OK, tuple(statuses))
