"""Unit tests for Redis key names and window arithmetic (extproc.core.keys)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.keys import (
    EXPIRY_SLACK_MS,
    WindowedBucket,
    bucket_key,
    ledger_key,
    rates_for,
    sanitize_request_id,
    tenant_tag,
    window_bounds,
    windowed,
)
from extproc.core.rules import Limit, Rates

pytestmark = pytest.mark.unit


def crc16_xmodem(data: bytes) -> int:
    """CRC16-CCITT (XMODEM): poly 0x1021, init 0, no reflection (Redis Cluster's key CRC)."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
            crc &= 0xFFFF
    return crc


def key_slot(key: str) -> int:
    """Redis Cluster's HASH_SLOT: the first non-empty {...} hash tag if any, else the whole key."""
    raw = key.encode()
    start = raw.find(b"{")
    if start >= 0:
        end = raw.find(b"}", start + 1)
        if end > start + 1:
            raw = raw[start + 1 : end]
    return crc16_xmodem(raw) % 16384


def test_crc16_reference_values() -> None:
    """The test's CRC16 matches the Redis Cluster spec's reference value and known slots."""
    assert crc16_xmodem(b"123456789") == 0x31C3
    assert key_slot("foo") == 12182
    assert key_slot("{user1000}.following") == key_slot("{user1000}.followers")
    assert key_slot("foo{}{bar}") == crc16_xmodem(b"foo{}{bar}") % 16384


LIMITS = [
    Limit("rpm", 10, 60, "*", "tenant"),
    Limit("tpm", 1000, 60, "*", "tenant"),
    Limit("tpm", 50_000, 3600, "sim-small", "tenant"),
    Limit("rpm", 5, 1, "*", "key"),
    Limit("tpm", 9, 86400, "sim-small", "key"),
]

tenants = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=126, blacklist_characters="{}"),
    min_size=1,
    max_size=40,
)


@given(tenant=tenants, request_id=st.text(max_size=200), now_ms=st.integers(0, 2**42))
def test_all_keys_of_a_request_share_one_slot(tenant: str, request_id: str, now_ms: int) -> None:
    """Bucket keys and the ledger key of one request map to the tenant's cluster slot: its
    id's, or, for a slot id of an organisation's tenant (``@o.<org>/<tenant>``, what
    :func:`extproc.core.keys.slot_id` makes; a configured tenant's own id never starts with
    ``@``), the organisation's tag's (Hypothesis found ``'@/'``, whose tag is ``{@}``)."""
    keys = [b.key for b in windowed("aq", tenant, "key-1", LIMITS, now_ms)]
    keys.append(ledger_key("aq", tenant, request_id))
    tag = tenant.partition("/")[0] if tenant.startswith("@") else tenant
    expected = crc16_xmodem(tag.encode()) % 16384
    assert {key_slot(k) for k in keys} == {expected}
    assert all(k.startswith(f"aq:{{{tag}}}:") for k in keys)


def test_request_id_with_braces_cannot_change_the_slot() -> None:
    """A request id containing '{other}' does not move the ledger key to another slot."""
    key = ledger_key("aq", "acme", "{other}-id")
    assert "{other}" not in key
    assert key_slot(key) == key_slot(tenant_tag("aq", "acme"))


def test_tenant_tag_format() -> None:
    """The tenant prefix is ``prefix:{tenant}``."""
    assert tenant_tag("aq", "acme") == "aq:{acme}"


def test_bucket_key_tenant_scope() -> None:
    """A tenant-scoped key names metric, scope 't', model, window and index."""
    lim = Limit("tpm", 1000, 60, "*", "tenant")
    assert bucket_key("aq", "acme", "k1", lim, 42) == "aq:{acme}:tpm:t:*:60:42"


def test_bucket_key_key_scope() -> None:
    """A key-scoped limit's key carries ``k.<key name>``."""
    lim = Limit("rpm", 5, 3600, "sim-small", "key")
    assert bucket_key("aq", "acme", "k1", lim, 7) == "aq:{acme}:rpm:k.k1:sim-small:3600:7"


def test_key_scope_separates_keys_of_one_tenant() -> None:
    """Two API keys of a tenant get distinct key-scoped buckets but the same tenant-scoped one."""
    key_lim = Limit("rpm", 5, 60, "*", "key")
    ten_lim = Limit("rpm", 5, 60, "*", "tenant")
    assert bucket_key("aq", "t", "a", key_lim, 1) != bucket_key("aq", "t", "b", key_lim, 1)
    assert bucket_key("aq", "t", "a", ten_lim, 1) == bucket_key("aq", "t", "b", ten_lim, 1)


def test_distinct_limits_have_distinct_keys() -> None:
    """Every limit of a request gets its own counter."""
    keys = [b.key for b in windowed("aq", "acme", "k1", LIMITS, 123_456_789)]
    assert len(set(keys)) == len(LIMITS)


@pytest.mark.parametrize(
    ("now_ms", "index", "end"),
    [
        (0, 0, 60_000),
        (59_999, 0, 60_000),
        (60_000, 1, 120_000),
        (60_001, 1, 120_000),
        (119_999, 1, 120_000),
        (1_699_999_980_000, 28_333_333, 1_700_000_040_000),
    ],
)
def test_minute_window_boundaries(now_ms: int, index: int, end: int) -> None:
    """The window index is now // window; the window ends at (index+1) * window."""
    lim = Limit("rpm", 10, 60, "*", "tenant")
    (b,) = windowed("aq", "acme", "k1", [lim], now_ms)
    assert b.key.endswith(f":60:{index}")
    assert b.window_end_ms == end
    assert b.expire_at_ms == end + EXPIRY_SLACK_MS
    assert b.reset_s(now_ms) == pytest.approx((end - now_ms) / 1000)


def test_second_and_day_windows() -> None:
    """One-second and one-day windows use their own lengths."""
    now = 86_400_000 * 3 + 1_500
    sec, day = windowed(
        "aq",
        "acme",
        "k1",
        [Limit("rpm", 1, 1, "*", "tenant"), Limit("tpm", 1, 86400, "*", "tenant")],
        now,
    )
    assert sec.key.endswith(f":1:{now // 1000}")
    assert sec.window_end_ms == now - 500 + 1000
    assert day.key.endswith(":86400:3")
    assert day.window_end_ms == 86_400_000 * 4


def test_reset_never_negative() -> None:
    """Asked after the window ended, reset_s is 0, not negative."""
    (b,) = windowed("aq", "acme", "k1", [Limit("rpm", 1, 60, "*", "tenant")], 10_000)
    assert b.reset_s(60_000) == 0.0
    assert b.reset_s(70_000) == 0.0


@given(now_ms=st.integers(0, 2**45), window_s=st.sampled_from([1, 60, 3600, 86400]))
def test_window_contains_now(now_ms: int, window_s: int) -> None:
    """``now`` lies in [end - window, end) and the key expires EXPIRY_SLACK_MS after the end."""
    (b,) = windowed("aq", "t", "k", [Limit("tpm", 1, window_s, "*", "tenant")], now_ms)
    w = window_s * 1000
    assert b.window_end_ms - w <= now_ms < b.window_end_ms
    assert b.window_end_ms % w == 0
    assert b.expire_at_ms - b.window_end_ms == EXPIRY_SLACK_MS


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("abc-123_x.y:z", "abc-123_x.y:z"),
        ("{evil}", "_evil_"),
        ("a b/c", "a_b_c"),
        ("", "_"),
        ("é", "_"),
    ],
)
def test_sanitize_request_id(raw: str, clean: str) -> None:
    """Unsafe characters (braces included) become '_'; an empty id becomes '_'."""
    assert sanitize_request_id(raw) == clean


def test_sanitize_request_id_bounds_length() -> None:
    """A long request id is cut to 128 characters."""
    out = sanitize_request_id("x" * 1000)
    assert out == "x" * 128


@given(st.text(max_size=500))
def test_sanitize_request_id_property(raw: str) -> None:
    """Any id sanitizes to 1..128 safe characters without braces."""
    out = sanitize_request_id(raw)
    assert 1 <= len(out) <= 128
    assert "{" not in out
    assert "}" not in out


def test_ledger_key_format() -> None:
    """The ledger key is ``prefix:{tenant}:req:<sanitized id>``."""
    assert ledger_key("aq", "acme", "req{1}") == "aq:{acme}:req:req_1_"


def _uncached(lim: Limit, now_ms: int, prices: Rates | None) -> WindowedBucket:
    """A fixed window's bucket as made before the cache (issue 27): the window arithmetic and
    the key of this module's own functions."""
    name, _, end = window_bounds(lim, now_ms)
    return WindowedBucket(
        limit=lim,
        key=bucket_key("aiq", "t1", "k1", lim, name),
        window_end_ms=end,
        expire_at_ms=end + EXPIRY_SLACK_MS,
        rates=rates_for(lim, prices),
    )


_PERIODS = st.sampled_from(
    [
        (60, None, "UTC"),
        (3600, None, "UTC"),
        (86400, None, "UTC"),
        (7 * 86400, None, "UTC"),
        (90, None, "UTC"),
        (86400, None, "Europe/Paris"),
        (7 * 86400, None, "America/New_York"),
        (0, "month", "UTC"),
    ]
)


@given(
    period=_PERIODS,
    now_ms=st.integers(min_value=0, max_value=4_000_000_000_000),
    step_ms=st.integers(min_value=0, max_value=40 * 86_400_000),
    metric=st.sampled_from(["rpm", "tpm", "cost"]),
)
def test_fixed_window_buckets_are_the_same_made_or_remembered(
    period: tuple[int, str | None, str], now_ms: int, step_ms: int, metric: str
) -> None:
    """Buckets of fixed windows come from a cache: the first and the repeated answer, and an
    answer in a later window, equal the bucket made from scratch (calendar windows too)."""
    window_s, named, tz = period
    lim = Limit(metric, 100, window_s, "*", "key", period=named, tz=tz, unit="USD")  # type: ignore[arg-type]
    prices = Rates(input=1, output=4)
    for t in (now_ms, now_ms, now_ms + step_ms, now_ms):
        got = windowed("aiq", "t1", "k1", [lim], t, prices=prices)
        assert got == [_uncached(lim, t, prices)]


def test_remembered_buckets_follow_the_objects_they_were_made_for() -> None:
    """Another limit object, other prices or another key make their own buckets."""
    now = 1_764_800_000_000
    lim = Limit("cost", 100, 3600, "*", "key", unit="USD")
    a, b = Rates(input=1, output=4), Rates(input=2, output=8)
    assert windowed("aiq", "t", "k", [lim], now, prices=a)[0].rates is a
    assert windowed("aiq", "t", "k", [lim], now, prices=b)[0].rates is b
    twin = Limit("cost", 200, 3600, "*", "key", unit="USD")
    assert windowed("aiq", "t", "k", [twin], now, prices=a)[0].limit is twin
    assert windowed("aiq", "t", "k2", [lim], now, prices=a)[0].key.endswith(
        bucket_key("aiq", "t", "k2", lim, now // 3_600_000)
    )
