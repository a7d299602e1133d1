"""An OTLP/gRPC sink for the telemetry benchmark: accepts trace and metrics exports (with
opentelemetry-proto's service stubs) and counts them, so that the processors' exporters do
their real work against a real endpoint while the benchmark measures them."""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as mpb
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as mgrpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc

from extproc.stack import free_port


class OtlpSink:
    """A running sink: its endpoint and how many spans and metric exports it took."""

    def __init__(self) -> None:
        self.port = free_port()
        self.spans = 0
        self.metric_exports = 0
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        tgrpc.add_TraceServiceServicer_to_server(_Traces(self), self._server)  # type: ignore[no-untyped-call]
        mgrpc.add_MetricsServiceServicer_to_server(_Metrics(self), self._server)  # type: ignore[no-untyped-call]
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def took_spans(self, n: int) -> None:
        with self._lock:
            self.spans += n

    def took_metrics(self) -> None:
        with self._lock:
            self.metric_exports += 1

    def stop(self) -> None:
        self._server.stop(0).wait()


class _Traces(tgrpc.TraceServiceServicer):
    def __init__(self, sink: OtlpSink) -> None:
        self.sink = sink

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the gRPC method
        self.sink.took_spans(
            sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        )
        return tpb.ExportTraceServiceResponse()


class _Metrics(mgrpc.MetricsServiceServicer):
    def __init__(self, sink: OtlpSink) -> None:
        self.sink = sink

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the gRPC method
        self.sink.took_metrics()
        return mpb.ExportMetricsServiceResponse()
