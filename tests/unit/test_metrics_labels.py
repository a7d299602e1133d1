"""Labelled metrics answer ``labels()`` from a cache of their children (issue 27): the same
child every time, the same exported samples as prometheus_client's own, and a removal or a
clear forgets the cache."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from extproc.metrics import Metrics

pytestmark = pytest.mark.unit


def test_labels_returns_the_same_child_and_counts_what_it_is_given() -> None:
    m = Metrics(CollectorRegistry())
    first = m.decisions.labels("admitted", "ok")
    assert m.decisions.labels("admitted", "ok") is first
    for _ in range(3):
        m.decisions.labels("admitted", "ok").inc()
    m.decisions.labels(decision="refused", code="tpm_limit_exceeded").inc(2)
    m.decisions.labels("refused", "tpm_limit_exceeded").inc()
    get = m.registry.get_sample_value
    assert get("aiq_decisions_total", {"decision": "admitted", "code": "ok"}) == 3
    assert get("aiq_decisions_total", {"decision": "refused", "code": "tpm_limit_exceeded"}) == 3
    m.tokenize_seconds.labels("chat").observe(0.001)
    assert get("aiq_tokenize_seconds_count", {"api": "chat"}) == 1
    m.redis_reachable.set(1)  # unlabelled metrics are untouched
    assert get("aiq_redis_reachable") == 1


def test_remove_and_clear_forget_the_cached_children() -> None:
    m = Metrics(CollectorRegistry())
    m.endings.labels("completed").inc(5)
    m.endings.remove("completed")
    m.endings.labels("completed").inc()
    get = m.registry.get_sample_value
    assert get("aiq_request_endings_total", {"ending": "completed"}) == 1
    m.endings.clear()
    m.endings.labels("completed").inc(2)
    assert get("aiq_request_endings_total", {"ending": "completed"}) == 2


def test_wrong_label_count_is_still_an_error() -> None:
    m = Metrics(CollectorRegistry())
    with pytest.raises(ValueError):
        m.decisions.labels("admitted")
