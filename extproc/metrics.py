"""Prometheus metrics, created on an injected registry (tests pass a fresh one).

Labels are low-cardinality only (never a tenant or key: per-tenant usage belongs in the usage
records, not in metric labels).  ``deploy/`` dashboards and alert rules use these names; a test
checks that every metric they reference exists here.
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry


class _LabelCache:
    """``labels()`` answered from a dict of the children already made (hot path: about ten
    labelled updates per request; prometheus_client validates and locks on every call, about
    1.2 µs, a dict hit 0.1 µs).  The cache holds exactly the children the metric itself keeps
    (low-cardinality labels only, never removed), keyed by the values as passed."""

    _children: dict[tuple[Any, ...], Any]

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> Any:
        """The child for these label values (made once, by prometheus_client)."""
        if labelkwargs:
            return super().labels(*labelvalues, **labelkwargs)  # type: ignore[misc]
        try:
            return self._children[labelvalues]
        except AttributeError:
            self._children = {}
        except KeyError:
            pass
        child = super().labels(*labelvalues)  # type: ignore[misc]
        self._children[labelvalues] = child
        return child

    def remove(self, *labelvalues: Any) -> None:
        """Remove a child (and forget every cached one)."""
        self._children = {}
        super().remove(*labelvalues)  # type: ignore[misc]

    def clear(self) -> None:
        """Remove every child (and forget the cached ones)."""
        self._children = {}
        super().clear()  # type: ignore[misc]


class Counter(_LabelCache, prometheus_client.Counter):
    """A Counter whose ``labels()`` is a dict lookup after the first call."""


class Gauge(_LabelCache, prometheus_client.Gauge):
    """A Gauge whose ``labels()`` is a dict lookup after the first call."""


class Histogram(_LabelCache, prometheus_client.Histogram):
    """A Histogram whose ``labels()`` is a dict lookup after the first call."""


_FAST = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class Metrics:
    """Every metric the gateway exports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # -- admission and limits ------------------------------------------------------------
        self.decisions = Counter(
            "aiq_decisions", "Admission decisions", ["decision", "code"], registry=r
        )
        self.limit_decisions = Counter(
            "aiq_limit_decisions",
            "Per limit kind: requests a limit allowed or refused (shadow: would have refused)",
            ["kind", "outcome"],
            registry=r,
        )
        # waiting instead of an immediate 429 (docs/semantics.md, "Waiting")
        self.waiters = Gauge(
            "aiq_waiters", "Requests this processor holds waiting for their turn", registry=r
        )
        self.wait_seconds = Histogram(
            "aiq_wait_seconds",
            "How long requests waited for their turn, by outcome (admitted, refused)",
            ["outcome"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 15, 20, 30, 45, 60),
            registry=r,
        )
        self.wait_outcomes = Counter(
            "aiq_wait_outcomes",
            "Requests of waiting plans over a rate limit, by outcome: admitted (after "
            "waiting), refused (after waiting), unservable (refused at once: the turn is "
            "beyond the maximum wait), queue_full, replica_full",
            ["outcome"],
            registry=r,
        )
        self.admission_seconds = Histogram(
            "aiq_admission_seconds",
            "Time from request body to decision",
            buckets=_FAST,
            registry=r,
        )
        self.tokenize_seconds = Histogram(
            "aiq_tokenize_seconds",
            "Time to count a request's input tokens",
            ["api"],
            buckets=_FAST,
            registry=r,
        )
        self.tokens = Counter(
            "aiq_tokens_charged", "TPM tokens charged (net, after settlement)", ["kind"], registry=r
        )
        self.model_tokens = Counter(
            "aiq_model_tokens",
            "Tokens settled by model and kind (input, cached_input, output, reasoning)",
            ["model", "kind"],
            registry=r,
        )
        # -- streams and endings -------------------------------------------------------------
        self.endings = Counter(
            "aiq_request_endings", "How admitted requests ended", ["ending"], registry=r
        )
        self.stream_cuts = Counter(
            "aiq_stream_cuts", "Streams the gateway cut off, by reason", ["reason"], registry=r
        )
        self.allowance_units = Counter(
            "aiq_allowance_units",
            "Units of local allowances: taken (pre-debited in Redis), returned (given back), "
            "expired (their window ended while held), reclaimed (dead replicas' never-opened "
            "tranches given back)",
            ["event"],
            registry=r,
        )
        self.allowance_takes = Counter(
            "aiq_allowance_takes",
            "Allowance take calls per bucket: granted, none (near the limit), failed",
            ["outcome"],
            registry=r,
        )
        self.allowance_saved_calls = Counter(
            "aiq_allowance_saved_calls",
            "Admissions, stream charges and settlements served from local allowances "
            "(the Redis calls they would have made)",
            ["call"],
            registry=r,
        )
        self.stream_charges = Counter(
            "aiq_stream_charges", "Redis charges made while streams ran", ["mode"], registry=r
        )
        self.active_streams = Gauge("aiq_active_streams", "Streams being metered", registry=r)
        self.usage_disagreements = Counter(
            "aiq_usage_disagreements",
            "Upstream usage figures outside the bounds the gateway trusts",
            ["direction"],
            registry=r,
        )
        # -- settlement ----------------------------------------------------------------------
        self.settlements = Counter(
            "aiq_settlements", "Settlement calls by outcome", ["outcome"], registry=r
        )
        self.settlement_pushback = Counter(
            "aiq_settlement_pushback",
            "Admissions pushed back because the settlements waiting for Redis reached the "
            "backlog limit (refused with a 503 when failing closed, passed unmetered when "
            "failing open): no settlement is ever dropped",
            ["outcome"],
            registry=r,
        )
        self.input_notes = Counter(
            "aiq_input_notes",
            "Exact input counts of requests admitted on a bound, noted in their open ledgers "
            "(written; closed: the ledger was settled first; failed: Redis did not answer; "
            "dropped: the queue was full)",
            ["outcome"],
            registry=r,
        )
        self.settlement_backlog = Gauge(
            "aiq_settlement_backlog",
            "Settlements kept in memory until Redis answers again",
            registry=r,
        )
        # -- usage records (docs/usage-records.md) ------------------------------------------
        self.usage_records = Counter(
            "aiq_usage_records",
            "Usage records by outcome (written, retried: written after a failed attempt, dropped)",
            ["outcome"],
            registry=r,
        )
        self.usage_record_backlog = Gauge(
            "aiq_usage_record_backlog",
            "Usage records kept in memory until Redis takes them",
            registry=r,
        )
        self.input_admissions = Counter(
            "aiq_input_admissions",
            "Admissions by how the input was known: counted first (exact), on an upper bound "
            "counted after (bound), or a bound refused and counted again (recounted)",
            ["how"],
            registry=r,
        )
        self.input_shortcut_stops = Counter(
            "aiq_input_shortcut_stops",
            "Models whose upstream input figure a count contradicted: their requests admitted "
            "on a bound are counted from then on instead of billed at the upstream's figure",
            ["model"],
            registry=r,
        )
        self.input_unbilled_estimate = Counter(
            "aiq_input_unbilled_estimate_tokens",
            "Input tokens a stopped shortcut revealed as probably unbilled: the requests this "
            "replica billed at the upstream's figure since the model's last agreeing count, "
            "scaled by how far the disagreeing count was above the upstream's figure",
            ["model"],
            registry=r,
        )
        self.input_stops_adopted = Counter(
            "aiq_input_shortcut_stops_adopted",
            "Models whose shortcut this replica stopped because another replica (or this one "
            "before a restart) found a disagreement: read from Redis",
            ["model"],
            registry=r,
        )
        self.duplicate_hits = Counter(
            "aiq_idempotent_duplicates",
            "Limiter calls that found their ledger entry already applied",
            ["op"],
            registry=r,
        )
        # -- Redis ---------------------------------------------------------------------------
        self.limiter_errors = Counter(
            "aiq_limiter_errors", "Redis calls that failed or timed out", ["op"], registry=r
        )
        self.redis_seconds = Histogram(
            "aiq_redis_call_seconds",
            "Redis script call latency by script and outcome (ok, error, timeout, breaker, noscript)",
            ["script", "outcome"],
            buckets=_FAST,
            registry=r,
        )
        self.redis_pool_in_use = Gauge(
            "aiq_redis_pool_in_use", "Redis connections checked out of the pool", registry=r
        )
        self.redis_reachable = Gauge(
            "aiq_redis_reachable",
            "1 while this replica's Redis answers its health PING (every 2 s; the "
            "aiquota.v1.Redis health state), else 0; traffic or not",
            registry=r,
        )
        self.breaker_state = Gauge(
            "aiq_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open", registry=r
        )
        # -- Redis HA (extproc.limiter.failover, docs/operations.md "Redis HA") -------------
        self.redis_failovers = Counter(
            "aiq_redis_failovers",
            "New Redis masters seen (a promoted replica or a restarted server: its run id changed)",
            registry=r,
        )
        self.redis_waits = Counter(
            "aiq_redis_waits",
            "Calls that found Redis unavailable and were sent again within "
            "AIQ_REDIS_FAILOVER_WAIT_S (outcome waited), and those that failed past it (failed)",
            ["outcome"],
            registry=r,
        )
        self.journal_replays = Counter(
            "aiq_journal_replays",
            "Times this replica replayed its journal of acknowledged charges to a new master",
            registry=r,
        )
        self.journal_replayed = Counter(
            "aiq_journal_replayed_calls",
            "Acknowledged script calls re-sent to a new master (idempotent: one the new master "
            "already had changed nothing)",
            ["script"],
            registry=r,
        )
        self.journal_entries = Gauge(
            "aiq_journal_entries",
            "Acknowledged charges held for replay after a failover",
            registry=r,
        )
        self.journal_dropped = Gauge(
            "aiq_journal_dropped",
            "Journal entries pushed out by its size bound before their window ended (since start)",
            registry=r,
        )
        # -- configuration -------------------------------------------------------------------
        self.config_version = Gauge(
            "aiq_config_version_info",
            "Always 1; the label is a hash of the effective rules",
            ["version"],
            registry=r,
        )
        self.config_reloads = Counter(
            "aiq_config_reloads", "Rules reloads by outcome", ["outcome"], registry=r
        )
        self.config_reload_failed = Gauge(
            "aiq_config_reload_failed",
            "1 while the last rules reload (SIGHUP) failed and the replica runs its previous "
            "rules (the aiquota.v1.Config health state), 0 once rules load",
            registry=r,
        )
        self.config_reload_time = Gauge(
            "aiq_config_last_reload_timestamp_seconds",
            "Unix time of the last successful rules load",
            registry=r,
        )
        self.tokenizer_load_failures = Counter(
            "aiq_tokenizer_load_failures", "Tokenizers that failed to load", registry=r
        )
        # -- the admin store and API ---------------------------------------------------------
        self.admin_store_version = Gauge(
            "aiq_admin_store_applied_version",
            "The admin store version this replica's rules were built from",
            registry=r,
        )
        self.admin_store_up = Gauge(
            "aiq_admin_store_reachable",
            "1 while the admin store answers this replica's version poll, else 0",
            registry=r,
        )
        self.admin_calls = Counter(
            "aiq_admin_calls",
            "Admin API calls by method and gRPC status code",
            ["method", "code"],
            registry=r,
        )
        # -- the gRPC port's door (extproc.access, docs/security.md) -------------------------
        self.grpc_refused = Counter(
            "aiq_grpc_refused",
            "Calls on the gRPC port refused for their credential, by service (ext_proc, rls, "
            "usage, other) and reason (missing, wrong_token, san_not_allowed, unknown_key, "
            "other_tenant)",
            ["service", "reason"],
            registry=r,
        )
