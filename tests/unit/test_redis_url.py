"""The one Redis URL parser every client factory uses: the three topologies, and a clear error
for each malformed URL (never a traceback from deep inside redis-py)."""

from __future__ import annotations

import re

import pytest

from extproc.limiter.redis_url import RedisUrlError, parse_redis_url, redact

pytestmark = pytest.mark.unit


def test_single_and_cluster() -> None:
    single = parse_redis_url("redis://127.0.0.1:6379/2")
    assert (single.kind, single.tls, single.plain_url) == (
        "single",
        False,
        "redis://127.0.0.1:6379/2",
    )
    tls = parse_redis_url("rediss://h:6380/0")
    assert (tls.kind, tls.tls) == ("single", True)
    cluster = parse_redis_url("redis+cluster://u:p@10.0.0.1:7000")
    assert (cluster.kind, cluster.plain_url) == ("cluster", "redis://u:p@10.0.0.1:7000")
    assert parse_redis_url("rediss+cluster://h:7000").plain_url == "rediss://h:7000"


def test_sentinel_full() -> None:
    t = parse_redis_url(
        "rediss+sentinel://app:s%40cret@s1:26379,s2:26380,[::1]:26381/my-master/3"
        "?ssl_ca_certs=/ca.pem&sentinel_password=sp"
    )
    assert t.kind == "sentinel" and t.tls
    assert t.sentinels == (("s1", 26379), ("s2", 26380), ("::1", 26381))
    assert (t.master, t.db, t.username, t.password) == ("my-master", 3, "app", "s@cret")
    assert t.options == {"ssl_ca_certs": "/ca.pem"}
    assert t.sentinel_auth == {"password": "sp"}


def test_sentinel_defaults() -> None:
    t = parse_redis_url("redis+sentinel://sentinel/mymaster")
    assert t.sentinels == (("sentinel", 26379),)
    assert (t.master, t.db, t.username, t.password, t.tls) == ("mymaster", 0, None, None, False)
    only_password = parse_redis_url("redis+sentinel://secret@h:1/m/")
    assert (only_password.username, only_password.password) == (None, "secret")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("127.0.0.1:6379", "not a Redis URL"),
        ("http://h:1/0", "unknown scheme 'http'"),
        ("redis+sentinel://h:1", "no master name"),
        ("redis+sentinel://h:1/", "no master name"),
        ("redis+sentinel:///m", "no sentinel address"),
        ("redis+sentinel://h:x/m", "port 'x' is not a number"),
        ("redis+sentinel://h:70000/m", "out of range"),
        ("redis+sentinel://h:1,,h:2/m", "empty sentinel address"),
        ("redis+sentinel://h:1/m/x", "database 'x' is not a number"),
        ("redis+sentinel://h:1/m/0/1", "too many path segments"),
        ("redis+sentinel://h:1/m?ssl_ca_certs=/x", "needs rediss+sentinel://"),
        ("redis+sentinel://h:1/m?bogus=1", "unknown option 'bogus'"),
        ("redis+cluster://:7000", "no host"),
    ],
)
def test_malformed(url: str, says: str) -> None:
    with pytest.raises(RedisUrlError, match=re.escape(says)):
        parse_redis_url(url)


def test_errors_never_show_a_password() -> None:
    with pytest.raises(RedisUrlError) as err:
        parse_redis_url("redis+sentinel://u:hunter2@h:1")
    assert "hunter2" not in str(err.value) and "u:***@h:1" in str(err.value)
    assert "sp" not in redact("redis+sentinel://h:1/m?sentinel_password=sp").split("?")[1]
