"""The OTLP metrics, aggregated here and exported with the SDK's OTLP exporter.

The SDK's own instruments cost about 30 µs per measurement in this process (each call cleans
and hashes its attributes again), some 150 µs for the five or six a request makes: a tenth of
a request's processor CPU (measured: ``scripts/bench --only telemetry``).  The attribute sets
here are few and built by the gateway itself (configuration names only), so each instrument
keeps its points in a dict keyed by the attribute tuple and a measurement is a dict lookup and
a bisect; a background thread turns them into the SDK's data model
(:class:`~opentelemetry.sdk.metrics.export.MetricsData`, cumulative temporality) every
``OTEL_METRIC_EXPORT_INTERVAL`` and hands them to the OTLP exporter, which encodes and sends
them as the SDK's own reader would.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

log = logging.getLogger("extproc.telemetry")

AttrKey = tuple[tuple[str, Any], ...]

#: Attribute sets one instrument keeps at most (the OpenTelemetry SDK's default limit); past
#: it, measurements go to the ``otel.metric.overflow`` set, as the specification says.
MAX_POINTS = 2000
_OVERFLOW: AttrKey = (("otel.metric.overflow", True),)


class _HistPoint:
    __slots__ = ("count", "counts", "max", "min", "sum")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * buckets
        self.count = 0
        self.sum = 0.0
        self.min = float("inf")
        self.max = float("-inf")


class LocalHistogram:
    """A histogram with explicit bucket bounds, one point per attribute set."""

    def __init__(
        self, name: str, unit: str, description: str, bounds: Sequence[float], lock: threading.Lock
    ) -> None:
        self.name, self.unit, self.description = name, unit, description
        self.bounds = tuple(float(b) for b in bounds)
        self.points: dict[AttrKey, _HistPoint] = {}
        self._lock = lock

    def record(self, value: float, attrs: AttrKey) -> None:
        with self._lock:
            p = self.points.get(attrs)
            if p is None:
                key = attrs if len(self.points) < MAX_POINTS else _OVERFLOW
                p = self.points.get(key)
                if p is None:
                    p = self.points[key] = _HistPoint(len(self.bounds) + 1)
            p.counts[bisect_left(self.bounds, value)] += 1
            p.count += 1
            p.sum += value
            p.min = min(p.min, value)
            p.max = max(p.max, value)

    def metric(self, start_ns: int, now_ns: int) -> Metric:
        points = [
            HistogramDataPoint(
                attributes=dict(k),
                start_time_unix_nano=start_ns,
                time_unix_nano=now_ns,
                count=p.count,
                sum=p.sum,
                bucket_counts=list(p.counts),
                explicit_bounds=list(self.bounds),
                min=p.min,
                max=p.max,
            )
            for k, p in self.points.items()
        ]
        return Metric(
            name=self.name,
            description=self.description,
            unit=self.unit,
            data=Histogram(
                data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE
            ),
        )


class LocalCounter:
    """A monotonic counter, one point per attribute set."""

    def __init__(self, name: str, unit: str, description: str, lock: threading.Lock) -> None:
        self.name, self.unit, self.description = name, unit, description
        self.points: dict[AttrKey, int] = {}
        self._lock = lock

    def add(self, value: int, attrs: AttrKey) -> None:
        with self._lock:
            if attrs not in self.points and len(self.points) >= MAX_POINTS:
                attrs = _OVERFLOW
            self.points[attrs] = self.points.get(attrs, 0) + value

    def metric(self, start_ns: int, now_ns: int) -> Metric:
        points = [
            NumberDataPoint(
                attributes=dict(k), start_time_unix_nano=start_ns, time_unix_nano=now_ns, value=v
            )
            for k, v in self.points.items()
        ]
        return Metric(
            name=self.name,
            description=self.description,
            unit=self.unit,
            data=Sum(
                data_points=points,
                aggregation_temporality=AggregationTemporality.CUMULATIVE,
                is_monotonic=True,
            ),
        )


class LocalMetrics:
    """The process's instruments, what :meth:`collect` turns into the SDK's data model, and
    the thread that exports it every ``interval_ms`` (:meth:`start`)."""

    def __init__(self, resource: Resource, scope: str, version: str = "") -> None:
        self.resource = resource
        self.scope = InstrumentationScope(scope, version)
        self.lock = threading.Lock()
        self.instruments: list[LocalHistogram | LocalCounter] = []
        self.start_ns = time.time_ns()
        self._exporter: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._timeout_ms = 30_000.0

    def histogram(
        self, name: str, unit: str, description: str, bounds: Sequence[float]
    ) -> LocalHistogram:
        h = LocalHistogram(name, unit, description, bounds, self.lock)
        self.instruments.append(h)
        return h

    def counter(self, name: str, unit: str, description: str) -> LocalCounter:
        c = LocalCounter(name, unit, description, self.lock)
        self.instruments.append(c)
        return c

    def collect(self) -> MetricsData:
        """Every instrument's cumulative points now."""
        now = time.time_ns()
        with self.lock:
            metrics = [i.metric(self.start_ns, now) for i in self.instruments if i.points]
        return MetricsData(
            resource_metrics=[
                ResourceMetrics(
                    resource=self.resource,
                    scope_metrics=[ScopeMetrics(scope=self.scope, metrics=metrics, schema_url="")],
                    schema_url="",
                )
            ]
        )

    def start(self, exporter: Any, interval_ms: float, timeout_ms: float) -> None:
        """Export every ``interval_ms`` from a daemon thread."""
        self._exporter, self._timeout_ms = exporter, timeout_ms
        self._thread = threading.Thread(
            target=self._run, args=(interval_ms / 1000,), name="aiq-otlp-metrics", daemon=True
        )
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self._export()

    def _export(self) -> None:
        exporter = self._exporter
        if exporter is None:
            return
        try:
            exporter.export(self.collect(), timeout_millis=self._timeout_ms)
        except Exception:  # a collector down costs a lost export, never a request
            log.exception("otlp_metrics_export_failed")

    def close(self, timeout_s: float) -> None:
        """The last export, then the exporter stops."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._export()
        if self._exporter is not None:
            self._exporter.shutdown(timeout_millis=timeout_s * 1000)
            self._exporter = None
