"""An OTLP receiver for tests: a gRPC server implementing OpenTelemetry's trace and metrics
collector services (opentelemetry-proto's own service stubs), keeping every export it gets.

What it holds is read the way a tracing backend would read it: spans by trace, with their
attributes decoded from OTLP's ``AnyValue``s; metrics by name with unit and data points."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as mpb
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as mgrpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from extproc.stack import free_port

T = TypeVar("T")


def value_of(v: AnyValue) -> Any:
    """An OTLP ``AnyValue`` as Python."""
    which = v.WhichOneof("value")
    if which == "array_value":
        return tuple(value_of(x) for x in v.array_value.values)
    if which == "kvlist_value":
        return attrs_of(v.kvlist_value.values)
    return getattr(v, which) if which else None


def attrs_of(kvs: Any) -> dict[str, Any]:
    return {kv.key: value_of(kv.value) for kv in kvs}


@dataclass
class Span:
    """One received span."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]


@dataclass
class Point:
    """One received metric data point."""

    service: str
    name: str
    unit: str
    kind: str  # histogram | sum | gauge
    attributes: dict[str, Any]
    value: float  # a sum's or gauge's value; a histogram's sum
    count: int = 0  # a histogram's count
    bounds: tuple[float, ...] = ()


@dataclass
class Receiver:
    """The server and what it received."""

    port: int = 0
    spans: list[Span] = field(default_factory=list)
    points: list[Point] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: Any = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Receiver:
        self.port = free_port()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        tgrpc.add_TraceServiceServicer_to_server(_Traces(self), server)  # type: ignore[no-untyped-call]
        mgrpc.add_MetricsServiceServicer_to_server(_Metrics(self), server)  # type: ignore[no-untyped-call]
        server.add_insecure_port(f"127.0.0.1:{self.port}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0).wait()

    def add_spans(self, req: Any) -> None:
        got = []
        for rs in req.resource_spans:
            service = str(attrs_of(rs.resource.attributes).get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Span(
                            service,
                            s.name,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            s.kind,
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            attrs_of(s.attributes),
                            [(e.name, attrs_of(e.attributes)) for e in s.events],
                        )
                    )
        with self._lock:
            self.spans += got

    def add_metrics(self, req: Any) -> None:
        got = []
        for rm in req.resource_metrics:
            service = str(attrs_of(rm.resource.attributes).get("service.name", ""))
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    if kind == "histogram":
                        for hp in m.histogram.data_points:
                            got.append(
                                Point(
                                    service,
                                    m.name,
                                    m.unit,
                                    kind,
                                    attrs_of(hp.attributes),
                                    hp.sum,
                                    hp.count,
                                    tuple(hp.explicit_bounds),
                                )
                            )
                    elif kind in ("sum", "gauge"):
                        for np_ in getattr(m, kind).data_points:
                            v = np_.as_int if np_.WhichOneof("value") == "as_int" else np_.as_double
                            got.append(
                                Point(service, m.name, m.unit, kind, attrs_of(np_.attributes), v)
                            )
        with self._lock:
            self.points += got

    def wait(self, what: Callable[[Receiver], T | None], timeout: float = 15.0) -> T:
        """Poll until ``what`` returns something (exports are batched and periodic)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                got = what(self)
            if got:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"not received within {timeout:.0f}s")
            time.sleep(0.1)

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans if s.trace_id == trace_id]


class _Traces(tgrpc.TraceServiceServicer):
    def __init__(self, r: Receiver) -> None:
        self.r = r

    def Export(self, request: Any, context: Any) -> Any:  # the gRPC method's name
        self.r.add_spans(request)
        return tpb.ExportTraceServiceResponse()


class _Metrics(mgrpc.MetricsServiceServicer):
    def __init__(self, r: Receiver) -> None:
        self.r = r

    def Export(self, request: Any, context: Any) -> Any:  # the gRPC method's name
        self.r.add_metrics(request)
        return mpb.ExportMetricsServiceResponse()


__all__ = ["KeyValue", "Point", "Receiver", "Span"]
