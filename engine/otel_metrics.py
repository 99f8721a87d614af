"""OpenTelemetry metrics for Tollgate's processes: the GenAI server metrics, exported over OTLP beside the
traces (``engine.tracing``) and turned on by the same rules. Torch-free: the gateway records them where a
generation ends (``gateway.generation.service``), the attributes built with its span's
(``gateway.tracing``).

Invariants:
- ``configure(service_name)`` sets the SDK's metrics up only when the environment asks for them:
  ``OTEL_METRICS_EXPORTER`` names ``otlp`` (or ``console``), or, with it unset, an OTLP endpoint is given
  (``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``). ``OTEL_SDK_DISABLED=true``
  or ``OTEL_METRICS_EXPORTER=none`` keeps them off whatever else is set (traces may stay on: each signal
  reads its own exporter variable); an exporter or protocol it does not know is a ``ValueError`` at
  start-up. Unconfigured it returns None having imported nothing of OpenTelemetry (its API included),
  and callers then record nothing.
- Each exporter has its ``PeriodicExportingMetricReader``: every ``OTEL_METRIC_EXPORT_INTERVAL`` ms
  (default 60000, bounded by ``OTEL_METRIC_EXPORT_TIMEOUT``), over OTLP, HTTP/protobuf unless
  ``OTEL_EXPORTER_OTLP_[METRICS_]PROTOCOL`` is ``grpc``; the exporter reads its endpoint, headers,
  timeout and temporality (cumulative unless ``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE``)
  itself. The resource is the traces' (``engine.tracing.process_resource``).
- The provider is the process's (``GenAIMetrics``), never OpenTelemetry's global one, and registers no
  exit hook: ``GenAIMetrics.shutdown`` (the app's lifespan) exports what was recorded since the last
  export, then stops.
- The instruments are the GenAI semantic conventions' (names, units, bucket boundaries): the model server
  metrics ``gen_ai.server.request.duration``, ``gen_ai.server.time_to_first_token`` and
  ``gen_ai.server.time_per_output_token`` (seconds), and, for token counts, ``gen_ai.client.token.usage``
  (``{token}``, by ``gen_ai.token.type``): the conventions define no server-side token metric, and this is
  the instrument they define for a request's billable input and output tokens. A dashboard built on the
  conventions reads it; ``service.name`` tells the gateway's apart from an application's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.tracing import otlp_protocol, process_resource, requested_exporters

if TYPE_CHECKING:
    from opentelemetry.metrics import Histogram
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricExporter

REQUEST_DURATION = "gen_ai.server.request.duration"
TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"
TIME_PER_OUTPUT_TOKEN = "gen_ai.server.time_per_output_token"
TOKEN_USAGE = "gen_ai.client.token.usage"

# Each instrument's unit, description and advised explicit bucket boundaries, as the conventions give them.
INSTRUMENTS: dict[str, tuple[str, str, tuple[float, ...]]] = {
    REQUEST_DURATION: (
        "s", "Generative AI server request duration such as time-to-last byte or last output token.",
        (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)),
    TIME_TO_FIRST_TOKEN: (
        "s", "Time to generate first token for successful responses.",
        (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)),
    TIME_PER_OUTPUT_TOKEN: (
        "s", "Time per output token generated after the first token for successful responses.",
        (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)),
    TOKEN_USAGE: (
        "{token}", "Number of input and output tokens used.",
        (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)),
}


@dataclass(frozen=True)
class GenAIMetrics:
    """A process's meter provider (the SDK's) and the GenAI server instruments recorded through it."""

    provider: MeterProvider
    request_duration: Histogram
    time_to_first_token: Histogram
    time_per_output_token: Histogram
    token_usage: Histogram

    def record(self, attributes: Mapping[str, Any], *, duration_s: float, error_type: str | None = None,
               ttft_s: float | None = None, tpot_s: float | None = None, input_tokens: int | None = None,
               output_tokens: int | None = None) -> None:
        """One request: its duration (with ``error.type`` when it failed), the time to its first token and
        per output token after it (given for a successful response only, as the conventions have them), and
        its input and output tokens (None: not counted). ``attributes``: the request's, without
        ``error.type`` (``gateway.tracing.metric_attributes``)."""
        failed = attributes if error_type is None else {**attributes, "error.type": error_type}
        self.request_duration.record(duration_s, failed)
        if ttft_s is not None:
            self.time_to_first_token.record(ttft_s, attributes)
        if tpot_s is not None:
            self.time_per_output_token.record(tpot_s, attributes)
        for token_type, count in (("input", input_tokens), ("output", output_tokens)):
            if count is not None:
                self.token_usage.record(count, {**attributes, "gen_ai.token.type": token_type})

    def shutdown(self) -> None:
        """Export what was recorded since the last export (bounded by the exporter's timeout) and stop."""
        self.provider.shutdown()


def _exporter(name: str) -> MetricExporter:
    if name == "console":
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

        return ConsoleMetricExporter()
    if otlp_protocol(signal="metrics") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcExporter

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter()


def configure(service_name: str) -> GenAIMetrics | None:
    """This process's GenAI metrics as the ``OTEL_*`` variables say, or None when they ask for none (see
    the module invariants); ``service_name`` is ``service.name`` unless the environment names one."""
    exporters = requested_exporters(signal="metrics")
    if not exporters:
        return None
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    readers = [PeriodicExportingMetricReader(_exporter(name)) for name in exporters]
    provider = MeterProvider(metric_readers=readers, resource=process_resource(service_name),
                             shutdown_on_exit=False)
    meter = provider.get_meter("tollgate")
    histograms = {name: meter.create_histogram(name, unit=unit, description=description,
                                               explicit_bucket_boundaries_advisory=buckets)
                  for name, (unit, description, buckets) in INSTRUMENTS.items()}
    return GenAIMetrics(provider, request_duration=histograms[REQUEST_DURATION],
                        time_to_first_token=histograms[TIME_TO_FIRST_TOKEN],
                        time_per_output_token=histograms[TIME_PER_OUTPUT_TOKEN],
                        token_usage=histograms[TOKEN_USAGE])
