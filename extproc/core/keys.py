"""Redis key names, built in exactly one place.

Every key of one request carries one Redis Cluster hash tag, so one Lua script only ever
touches keys of a single slot: the tenant (``{tenant}``), or, for a tenant inside an
organisation, the organisation (``{@o.acme}``: every tenant, key, team and end user of it
shares the slot; ``@`` never starts a tenant id, so the two never meet).  Functions here take
a tenant's *slot id*: its id alone (:func:`slot_id` without an organisation), or
``@o.<organisation>/<tenant>``.  Fixed windows are numbered from
the Unix epoch (``window_index = now // window``), like envoyproxy/ratelimit, so every
replica and every Envoy agree on the window without talking to each other.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Literal
from zoneinfo import ZoneInfo

from extproc.core.rules import (
    NO_RATES,
    RATE_SCALE,
    TOKEN_RATES,
    Limit,
    Metric,
    Rates,
    UnconfirmedCharge,
)

EXPIRY_SLACK_MS = 2_000
_SAFE_ID = re.compile(r"[^A-Za-z0-9._:-]")


@dataclass(frozen=True, slots=True)
class WindowedBucket:
    """One bucket in the window that contains ``now``."""

    limit: Limit
    key: str
    window_end_ms: int
    expire_at_ms: int
    # what each token kind adds to this counter for the request's model (cost: its prices)
    rates: Rates = field(default=TOKEN_RATES)
    # a sliding limit: the previous window's counter and the share of it (ppm) still inside
    prev_key: str = ""
    prev_weight: int = 0

    @property
    def metric(self) -> Metric:
        """``rpm``, ``tpm``, ``cost``, ``concurrency`` or ``users``."""
        return self.limit.metric

    @property
    def kind(self) -> Literal["rpm", "tpm", "concurrency", "users"]:
        """How the scripts treat the counter (cost counters are per-token like TPM)."""
        m = self.limit.metric
        return "tpm" if m == "cost" else m

    def reset_s(self, now_ms: int) -> float:
        """Seconds until this window ends and the bucket starts from zero (a sliding window
        frees room continuously; this is when its current part stops counting in full)."""
        return max(0.0, (self.window_end_ms - now_ms) / 1000.0)


def slot_id(tenant: str, organisation: str = "") -> str:
    """What names a tenant's keys: its id, or its organisation's tag and its id."""
    return f"@o.{organisation}/{tenant}" if organisation else tenant


def tenant_tag(prefix: str, tenant: str) -> str:
    """The common prefix of every key of a tenant (a slot id), including the hash tag."""
    if tenant.startswith("@"):
        return f"{prefix}:{{{tenant.partition('/')[0]}}}"
    return f"{prefix}:{{{tenant}}}"


#: End-user ids kept as they are in keys; any other is replaced by a digest of it.
_PLAIN_USER = re.compile(r"[A-Za-z0-9._@-]{1,64}")


def user_segment(user: str) -> str:
    """An end user's id as it appears in keys: as sent when short and plain, else ``h`` and a
    digest (never a ``:`` nor a brace: a client names it)."""
    if _PLAIN_USER.fullmatch(user):
        return user
    return "h" + hashlib.sha256(user.encode()).hexdigest()[:24]


def scope_segment(tenant: str, key_name: str, limit: Limit, user: str = "") -> str:
    """Whose counter a key is: ``t`` (the tenant), ``k.<key>``, ``o`` (the organisation),
    ``g.<team>``, ``u.<team>.<user>``; inside an organisation's tag tenant and key scopes
    name the tenant too (``t.<tenant>``, ``k.<tenant>.<key>``)."""
    scope = limit.scope
    inside = tenant.partition("/")[2] if tenant.startswith("@") else ""
    if scope == "tenant":
        return f"t.{inside}" if inside else "t"
    if scope == "key":
        return f"k.{inside}.{key_name}" if inside else f"k.{key_name}"
    if scope == "organisation":
        return "o"
    if scope == "team":
        return f"g.{limit.owner}"
    return f"u.{limit.owner}.{user_segment(user or '-')}"


def bucket_key(
    prefix: str, tenant: str, key_name: str, limit: Limit, window: int | str, *, user: str = ""
) -> str:
    """The counter for ``limit`` in the window named ``window`` (a fixed window's index)."""
    scope = scope_segment(tenant, key_name, limit, user)
    metric: str = limit.metric
    if metric == "concurrency":
        return f"{tenant_tag(prefix, tenant)}:conc:{scope}:{limit.model}"
    if metric == "cost":
        metric = f"cost.{unit_id(limit)}"
    if limit.sliding:
        metric += ".sliding"
    if limit.shadow:
        metric += ".shadow"
    return f"{tenant_tag(prefix, tenant)}:{metric}:{scope}:{limit.model}:{limit.window_s}:{window}"


@lru_cache(maxsize=256)
def unit_id(limit: Limit) -> str:
    """A cost counter's unit in its key: the currency, or the weights' short digest."""
    if limit.unit != "weighted" or limit.weights is None:
        return limit.unit
    w = limit.weights
    raw = f"{w.input},{w.cached_input},{w.output},{w.reasoning},{w.request}".encode()
    return "w" + hashlib.sha256(raw).hexdigest()[:8]


@lru_cache(maxsize=64)
def _zone(tz: str) -> ZoneInfo:
    return ZoneInfo(tz)


def _ms(dt: datetime) -> int:
    return int(dt.timestamp() * 1000)


def window_bounds(limit: Limit, now_ms: int) -> tuple[int | str, int, int]:
    """(window name, start ms, end ms) of ``limit``'s window containing ``now_ms``.

    Windows up to an hour, and days and weeks in UTC, are numbered from the Unix epoch (weeks
    start on Monday); a ``month`` is the calendar month, and days, weeks and months in
    another time zone follow its calendar (DST included)."""
    period = limit.period_name
    if period == "month" or (period in ("day", "week") and limit.tz != "UTC"):
        zone = _zone(limit.tz)
        local = datetime.fromtimestamp(now_ms / 1000, tz=UTC).astimezone(zone)
        day = local.replace(hour=0, minute=0, second=0, microsecond=0, tzinfo=None)
        if period == "month":
            start = day.replace(day=1)
            end = (start + timedelta(days=32)).replace(day=1)
            name: int | str = f"m{start.year:04d}{start.month:02d}"
        elif period == "week":
            start = day - timedelta(days=day.weekday())
            end = start + timedelta(days=7)
            name = f"w{start.year:04d}{start.month:02d}{start.day:02d}"
        else:
            start, end = day, day + timedelta(days=1)
            name = f"d{start.year:04d}{start.month:02d}{start.day:02d}"
        if limit.tz != "UTC":
            name = f"{name}.{limit.tz.replace('/', '.')}"
        return name, _ms(start.replace(tzinfo=zone)), _ms(end.replace(tzinfo=zone))
    w_ms = limit.window_s * 1000
    # Weeks start on Monday: the epoch (1970-01-01) was a Thursday.
    shift = 3 * 86_400_000 if period == "week" else 0
    idx = (now_ms + shift) // w_ms
    first = idx * w_ms - shift
    return idx, first, first + w_ms


def ledger_key(prefix: str, tenant: str, request_id: str) -> str:
    """The per-request ledger that makes admission, charges and settlement idempotent."""
    return f"{tenant_tag(prefix, tenant)}:req:{sanitize_request_id(request_id)}"


def input_stops_key(prefix: str, config_version: str) -> str:
    """The models whose input shortcut stopped under one config version (a hash, one Cluster
    slot: its own hash tag, not a tenant's)."""
    return f"{prefix}:{{input-stops}}:{sanitize_request_id(config_version or 'unversioned')}"


def open_key(ledger: str) -> str:
    """The sorted set of a tenant's open reservations, next to its ledgers (same hash tag)."""
    return ledger.rsplit(":req:", 1)[0] + ":open"


def sanitize_request_id(request_id: str) -> str:
    """A request id safe to embed in a key (no braces, bounded length)."""
    return _SAFE_ID.sub("_", request_id)[:128] or "_"


def windowed(
    prefix: str,
    tenant: str,
    key_name: str,
    limits: tuple[Limit, ...] | list[Limit],
    now_ms: int,
    *,
    prices: Rates | None = None,
    lease_ms: int = 0,
    user: str = "",
) -> list[WindowedBucket]:
    """The buckets of ``limits`` in the windows containing ``now_ms``.

    ``prices`` are the request's model's (money budgets); ``lease_ms`` how long a
    concurrency slot lives unrenewed (its set expires that long after ``now_ms``); ``user``
    the request's end user (limits of scope ``user``, and a team's cap on end users)."""
    out: list[WindowedBucket] = []
    cache = _FIXED
    for lim in limits:
        if lim.metric == "users":
            out.append(_users_bucket(prefix, tenant, lim, now_ms, user))
            continue
        if not lim.sliding and lim.metric != "concurrency":
            # a fixed window's bucket depends on the window, not on ``now``: made once
            idx = _epoch_window(lim, now_ms)
            if idx is not None:
                ck = (prefix, tenant, key_name, id(lim), idx, id(prices), user)
                hit = cache.get(ck)
                if hit is not None and hit[0] is lim and hit[1] is prices:
                    out.append(hit[2])
                    continue
                b = _fixed_bucket(prefix, tenant, key_name, lim, now_ms, prices=prices, user=user)
                if len(cache) >= _FIXED_MAX:
                    cache.clear()
                cache[ck] = (lim, prices, b)  # the objects held: their ids stay theirs
                out.append(b)
                continue
        if lim.metric == "concurrency":
            end = now_ms + lease_ms
            out.append(
                WindowedBucket(
                    limit=lim,
                    key=bucket_key(prefix, tenant, key_name, lim, 0, user=user),
                    window_end_ms=end,
                    expire_at_ms=end + EXPIRY_SLACK_MS,
                    rates=NO_RATES,
                )
            )
            continue
        name, start, end = window_bounds(lim, now_ms)
        prev_key, prev_weight, expire = "", 0, end + EXPIRY_SLACK_MS
        if lim.sliding and isinstance(name, int):
            # the previous window still counts for the share of it inside [now - W, now]
            prev_key = bucket_key(prefix, tenant, key_name, lim, name - 1, user=user)
            prev_weight = (end - now_ms) * SLIDING_SCALE // (end - start)
            expire = end + (end - start) + EXPIRY_SLACK_MS  # read as the previous one next
        out.append(
            WindowedBucket(
                limit=lim,
                key=bucket_key(prefix, tenant, key_name, lim, name, user=user),
                window_end_ms=end,
                expire_at_ms=expire,
                rates=rates_for(lim, prices),
                prev_key=prev_key,
                prev_weight=prev_weight,
            )
        )
    return out


def _epoch_window(lim: Limit, now_ms: int) -> int | None:
    """The index of ``lim``'s window containing ``now_ms`` when its windows are numbered from
    the epoch (as :func:`window_bounds` numbers them); None for calendar windows."""
    period = lim.period_name
    if period == "month" or (period in ("day", "week") and lim.tz != "UTC"):
        return None
    shift = 3 * 86_400_000 if period == "week" else 0
    return (now_ms + shift) // (lim.window_s * 1000)


def _users_bucket(prefix: str, tenant: str, lim: Limit, now_ms: int, user: str) -> WindowedBucket:
    """A team's distinct end users in the window: a set, the request's end user its member.

    The member travels as ``prev_key`` (a name in the same slot, never read as a key): the
    admission script adds it to the set, and refuses a new member once the set is full."""
    name, _, end = window_bounds(lim, now_ms)
    tag = tenant_tag(prefix, tenant)
    return WindowedBucket(
        limit=lim,
        key=f"{tag}:users:g.{lim.owner}:*:{lim.window_s}:{name}",
        window_end_ms=end,
        expire_at_ms=end + EXPIRY_SLACK_MS,
        rates=NO_RATES,
        prev_key=f"{tag}:user:{user_segment(user or '-')}",
    )


def _fixed_bucket(
    prefix: str,
    tenant: str,
    key_name: str,
    lim: Limit,
    now_ms: int,
    *,
    prices: Rates | None,
    user: str = "",
) -> WindowedBucket:
    name, _, end = window_bounds(lim, now_ms)
    return WindowedBucket(
        limit=lim,
        key=bucket_key(prefix, tenant, key_name, lim, name, user=user),
        window_end_ms=end,
        expire_at_ms=end + EXPIRY_SLACK_MS,
        rates=rates_for(lim, prices),
    )


#: Fixed-window buckets already made (frozen), by (prefix, tenant, key, limit, window,
#: prices); cleared when full.  Entries hold their limit and prices, so an id in a key is
#: never that of another object while the entry lives.
_FIXED: dict[
    tuple[str, str, str, int, int, int, str], tuple[Limit, Rates | None, WindowedBucket]
] = {}
_FIXED_MAX = 4096

#: A sliding window's weight of its previous window is in parts per million.
SLIDING_SCALE = 1_000_000


def rates_for(limit: Limit, prices: Rates | None) -> Rates:
    """What a token adds to ``limit``'s counter for a model priced ``prices``."""
    if limit.metric == "tpm":
        return TOKEN_RATES
    if limit.metric == "cost":
        if limit.weights is not None:
            return limit.weights
        return prices if prices is not None else NO_RATES
    return NO_RATES


#: A calendar month at its longest (31 days), for its counter's length.
MONTH_LONGEST_S = 31 * 86_400


@dataclass(frozen=True, slots=True)
class CounterName:
    """What a window counter's key (:func:`bucket_key`) says about it."""

    tag: str  # the tenant's common prefix, hash tag included (:func:`tenant_tag`)
    metric: str  # ``rpm``, ``tpm``, ``cost.USD``, ``tpm.sliding``, ``rpm.shadow``...
    window_s: int  # 0: a calendar month (its key names the month, not a length)

    @property
    def longest_s(self) -> int:
        """How long the window lasts at most: ``window_s``, a calendar month's 31 days."""
        return self.window_s or MONTH_LONGEST_S


@lru_cache(maxsize=4096)
def counter_name(key: str) -> CounterName | None:
    """Parse a window counter's key; None for any other key (a concurrency set, a ledger).

    Remembered (bounded): the same few counters are parsed on every admission."""
    end = key.find("}:")
    if end < 0:
        return None
    tag, rest = key[: end + 1], key[end + 2 :]
    metric, _, tail = rest.partition(":")
    parts = tail.rsplit(":", 2)
    if metric == "conc" or len(parts) != 3 or not parts[1].isdigit():
        return None
    return CounterName(tag, metric, int(parts[1]))


def room_after(buckets: Iterable[WindowedBucket], values: Iterable[int]) -> int | None:
    """Output tokens the tightest enforced bucket still has after a charge left it at
    ``values`` (None when no enforced bucket prices output)."""
    return min(
        (
            (b.limit.limit - v) * RATE_SCALE // b.rates.output
            for b, v in zip(buckets, values, strict=True)
            if not b.limit.shadow and b.rates.output > 0
        ),
        default=None,
    )


def unconfirmed_charge(seq: int, buckets: Iterable[WindowedBucket]) -> UnconfirmedCharge:
    """The record settlement needs to take back charge ``seq`` if it ran unanswered."""
    return UnconfirmedCharge(seq, tuple((b.key, b.rates.output) for b in buckets))
