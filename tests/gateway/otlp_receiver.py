"""A real OTLP/HTTP receiver for the telemetry tests (``test_traces.py``, ``test_genai_metrics.py``).

``OtlpReceiver`` listens on a free port and takes what an OpenTelemetry SDK exports to it, as the
OpenTelemetry Collector does: ``POST /v1/traces`` and ``POST /v1/metrics``, protobuf bodies (gzip or not)
decoded with ``opentelemetry-proto``'s messages and answered with the empty export response. Spans and
histogram data points are kept in arrival order; ``metric_exports`` counts the metrics requests, so a test
can say that nothing at all was exported.
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto

from tollgate.local_services import free_port


@dataclass
class ReceivedSpan:
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    attributes: dict[str, Any]
    events: list[str]
    error: bool


# A metric series: the metric's name and the data point's attributes.
SeriesKey = tuple[str, frozenset[tuple[str, Any]]]


@dataclass
class ReceivedHistogram:
    """One histogram data point as exported (cumulative: the series' totals since the process started)."""

    service: str
    name: str
    unit: str
    attributes: dict[str, Any]
    count: int
    sum: float
    explicit_bounds: list[float]
    temporality: int

    @property
    def key(self) -> SeriesKey:
        return self.name, frozenset(self.attributes.items())


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, which) if which else None


def _attributes(attributes: Any) -> dict[str, Any]:
    return {a.key: _value(a.value) for a in attributes}


class OtlpReceiver:
    """An OTLP/HTTP receiver: every span and histogram point exported to ``url`` (+ ``/v1/traces``,
    ``/v1/metrics``), decoded."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.histograms: list[ReceivedHistogram] = []
        self.metric_exports = 0
        received = self
        messages = {"/v1/traces": (ExportTraceServiceRequest, ExportTraceServiceResponse),
                    "/v1/metrics": (ExportMetricsServiceRequest, ExportMetricsServiceResponse)}

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path not in messages:
                    self.send_error(404)
                    return
                request, response = messages[self.path]
                received.add(request.FromString(body))
                answer = response().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()

    def add(self, request: ExportTraceServiceRequest | ExportMetricsServiceRequest) -> None:
        if isinstance(request, ExportTraceServiceRequest):
            self._add_spans(request)
        else:
            self._add_metrics(request)

    def _add_spans(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(ReceivedSpan(
                        service=resource.get("service.name", ""), trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(), parent_span_id=span.parent_span_id.hex(), name=span.name,
                        kind=span.kind, attributes=_attributes(span.attributes),
                        events=[e.name for e in span.events], error=span.status.code == 2,
                    ))
        with self._lock:
            self.spans.extend(spans)

    def _add_metrics(self, request: ExportMetricsServiceRequest) -> None:
        points = []
        for resource_metrics in request.resource_metrics:
            service = _attributes(resource_metrics.resource.attributes).get("service.name", "")
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if metric.WhichOneof("data") != "histogram":
                        continue
                    for point in metric.histogram.data_points:
                        points.append(ReceivedHistogram(
                            service=service, name=metric.name, unit=metric.unit,
                            attributes=_attributes(point.attributes), count=point.count, sum=point.sum,
                            explicit_bounds=list(point.explicit_bounds),
                            temporality=metric.histogram.aggregation_temporality,
                        ))
        with self._lock:
            self.metric_exports += 1
            self.histograms.extend(points)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def of_request(self, request_id: str, service: str) -> ReceivedSpan | None:
        """The span ``service`` made of the request ``request_id`` (the gateway's request span, or the
        engine's), once it arrived."""
        kind = SpanProto.SPAN_KIND_SERVER
        return next((s for s in self.spans if s.service == service and s.kind == kind
                     and s.attributes.get("tollgate.request.id") == request_id), None)

    def latest_histograms(self, service: str) -> dict[SeriesKey, ReceivedHistogram]:
        """Each of ``service``'s histogram series (metric name and attribute set) at its latest export."""
        with self._lock:
            return {point.key: point for point in self.histograms if point.service == service}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
