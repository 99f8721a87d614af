"""OpenTelemetry traces for Tollgate's processes, set up from the standard ``OTEL_*`` variables and off
unless they ask for it. Torch-free: the gateway sets its tracing up here too (the engine imports nothing
of the gateway's). What each side records: ``RequestTrace`` below for an engine replica,
``gateway.tracing`` for the gateway. The metrics beside the traces, turned on and off by the same rules
(``requested_exporters`` for either signal), are ``engine.otel_metrics``'.

Invariants:
- ``configure(service_name)`` sets the SDK up only when the environment asks for traces:
  ``OTEL_TRACES_EXPORTER`` names ``otlp`` (or ``console``), or, with it unset, an OTLP endpoint is given
  (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``). ``OTEL_SDK_DISABLED=true``
  or ``OTEL_TRACES_EXPORTER=none`` keeps it off whatever else is set; an exporter or protocol it does not
  know is a ``ValueError`` at start-up, not a process that silently traces nothing. Unconfigured it
  returns None without importing the SDK, and callers then record nothing at all: they check for None
  instead of starting the API's no-op spans (3-5 µs each, a few per request).
- Spans go out over OTLP, HTTP/protobuf unless ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` is ``grpc``,
  through a ``BatchSpanProcessor`` (``OTEL_BSP_*``), sampled by ``OTEL_TRACES_SAMPLER`` (the SDK's
  default, parent-based always-on, keeps a caller's decision); the exporter reads its endpoint, headers
  and timeout from the standard variables itself. ``service.name`` is ``OTEL_SERVICE_NAME`` (or
  ``OTEL_RESOURCE_ATTRIBUTES``), else the process's own (``tollgate-gateway``, ``tollgate-engine``).
- The provider is the process's (``Tracing``), never installed as OpenTelemetry's global one: a process
  may hold several apps (the tests do), and no library's own instrumentation starts exporting because
  Tollgate's traces were turned on. ``Tracing.shutdown`` flushes what is still queued.
- Context crosses processes as W3C Trace Context (``traceparent``/``tracestate``): ``extract`` from a
  request's headers, ``inject`` into an outgoing request's from the current span.
- No span carries a credential, a cache salt, a prompt or a completion: ids, names, counts and timings.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

    from engine.outputs import Timings
    from engine.usage import Usage

EXPORTERS = ("otlp", "console")
PROTOCOLS = ("http/protobuf", "grpc")
_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True)
class Tracing:
    """A process's tracer provider (the SDK's) and the tracer its spans start from."""

    provider: TracerProvider
    tracer: Tracer

    def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's timeout) and stop."""
        self.provider.shutdown()


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def requested_exporters(environ: Mapping[str, str] = os.environ, signal: str = "traces") -> list[str]:
    """The exporters the environment asks for one signal, ``traces`` or ``metrics`` (empty: it is off);
    ``ValueError`` for an exporter or an OTLP protocol this process cannot provide. The rules are the same
    for both (``OTEL_{SIGNAL}_EXPORTER``, the OTLP endpoints), each signal reading its own variables."""
    if _flag(environ.get("OTEL_SDK_DISABLED")):
        return []
    variable = f"OTEL_{signal.upper()}_EXPORTER"
    names = [n.strip().lower() for n in environ.get(variable, "").split(",") if n.strip()]
    if not names:
        endpoints = (f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
        names = ["otlp"] if any(environ.get(name) for name in endpoints) else []
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise ValueError(f"{variable}={','.join(names)}: {', '.join(unknown)} is not supported "
                         f"(one or more of {', '.join(EXPORTERS)}, or none)")
    protocol = otlp_protocol(environ, signal)
    if "otlp" in names and protocol not in PROTOCOLS:
        raise ValueError(f"OTLP protocol {protocol!r} is not supported for {signal} "
                         f"({' or '.join(PROTOCOLS)})")
    return names


def otlp_protocol(environ: Mapping[str, str] = os.environ, signal: str = "traces") -> str:
    protocol = (environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL"))
    return (protocol or "http/protobuf").strip().lower()


def process_resource(service_name: str) -> Resource:
    """The resource of this process's telemetry: the environment's (``OTEL_SERVICE_NAME``,
    ``OTEL_RESOURCE_ATTRIBUTES``), ``service.name`` defaulting to ``service_name``. The SDK adds a
    ``service.instance.id`` of the process's own unless the environment gives one: the workers of one
    gateway share a name, and each exports cumulative metrics that a backend must not take for one series."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    return resource


def _exporter(name: str) -> SpanExporter:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if otlp_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def configure(service_name: str) -> Tracing | None:
    """This process's tracing as the ``OTEL_*`` variables say, or None when they ask for none (see the
    module invariants); ``service_name`` is ``service.name`` unless the environment names one."""
    exporters = requested_exporters()
    if not exporters:
        return None
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=process_resource(service_name))
    for name in exporters:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    return Tracing(provider, provider.get_tracer("tollgate"))


def extract(headers: Mapping[str, str]) -> Context:
    """The caller's trace context from a request's headers (an empty context when it sent none)."""
    return _PROPAGATOR.extract(headers)


def inject(headers: MutableMapping[str, str]) -> None:
    """Add the current span's ``traceparent`` (and ``tracestate``) to outgoing headers; nothing when no
    span is current (tracing off)."""
    _PROPAGATOR.inject(headers)


def mark_error(span: Span, error_type: str, description: str | None = None) -> None:
    span.set_attribute("error.type", error_type)
    span.set_status(StatusCode.ERROR, description)


class RequestTrace:
    """An engine replica's span for one ``POST /generate``, a child of the caller's span (the gateway's
    engine call) when the request carries a ``traceparent``. Its timings are the engine's own, from the
    final record (seconds since the engine accepted the request): a child span for the queue, the
    prefill (until the first token) and the decode, a ``first_token`` event, and their lengths as
    attributes; with the usage and finish reasons the engine reported."""

    def __init__(self, tracer: Tracer, headers: Mapping[str, str], attributes: dict[str, Any]) -> None:
        self._tracer = tracer
        self.span = tracer.start_span("POST /generate", context=extract(headers), kind=SpanKind.SERVER,
                                      attributes={"http.request.method": "POST", "http.route": "/generate",
                                                  **attributes})
        self._accepted_ns = time.time_ns()
        self._ended = False

    def accepted(self) -> None:
        """The engine starts its clock now (``AsyncEngine.add_request``)."""
        self._accepted_ns = time.time_ns()

    def answered(self, status: int) -> None:
        """The answer when it is not a stream (an error: a 400 is the caller's, a 5xx the replica's)."""
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            mark_error(self.span, str(status))

    def failed(self, error_type: str) -> None:
        mark_error(self.span, error_type)

    def finished(self, finish_reasons: Sequence[str], usage: Usage, timings: Timings) -> None:
        span = self.span
        if not span.is_recording():
            return
        span.set_attributes({
            "gen_ai.response.finish_reasons": list(finish_reasons),
            "gen_ai.usage.input_tokens": usage.prompt_tokens,
            "gen_ai.usage.output_tokens": usage.completion_tokens,
            "tollgate.usage.cached_tokens": usage.cached_tokens,
            "tollgate.engine.queued_s": timings.queued,
            "tollgate.engine.ttft_s": timings.ttft,
            "tollgate.engine.tpot_s": timings.tpot,
        })
        at = self._accepted_ns
        scheduled, first_token, end = (at + int(s * 1e9) for s in (timings.queued, timings.ttft, timings.e2e))
        parent = trace.set_span_in_context(span)
        phases = [("queue", at, scheduled)]
        if timings.ttft > 0:  # a token came (an aborted or embedding request may have none)
            phases += [("prefill", scheduled, first_token), ("decode", first_token, end)]
            span.add_event("first_token", timestamp=first_token)
        for name, start, stop in phases:
            if stop >= start:
                self._tracer.start_span(name, context=parent, start_time=start).end(end_time=stop)

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self.span.end()
