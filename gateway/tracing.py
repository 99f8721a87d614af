"""What the gateway records in a trace (``engine.tracing`` sets the SDK up from the ``OTEL_*`` variables),
and the GenAI attributes its metrics share with it (``engine.otel_metrics``).

- ``TracingMiddleware``: one server span per OpenAI API request (``/v1/...``), named as OpenTelemetry's
  HTTP conventions name them (``POST /v1/chat/completions``), continuing the client's W3C
  ``traceparent``, from the request until its last byte (a stream included), with
  ``gen_ai.operation.name`` from the path and ``tollgate.request.id`` (the ``x-request-id``).
- The generation (``gateway.generation.service``) adds to that span what a request asked for and got
  (``request_attributes``, ``result_attributes``): ``gen_ai.request.*``, ``gen_ai.response.model`` and
  ``finish_reasons`` (the engine's), ``gen_ai.usage.input_tokens``/``output_tokens`` (the usage the
  client was answered),
  ``tollgate.tenant.id``, ``tollgate.tier``, ``tollgate.usage.cached_tokens``, ``tollgate.cost.pico_usd``
  (what the request was billed) and ``tollgate.status``; and its children: ``admission`` (shed check and
  admission), ``routing`` (each replica choice) and ``POST /generate`` (a client span per engine call,
  from sending it until its stream ended), under which the engine records its own span. The endpoint
  service that makes the answer's id puts it there (``set_response_id``: chat, completions, responses).
- The GenAI server metrics of a generation (recorded once by ``gateway.generation.service``) carry
  ``metric_attributes``: the span's ``gen_ai.provider.name``, ``gen_ai.request.model`` and
  ``tollgate.tier`` (``generation_attributes``, built once for both), ``gen_ai.response.model``, and
  ``gen_ai.operation.name``, which ``current_operation`` reads off the API path being served (the
  request context's), as the middleware names the span's; ``error.type`` is ``error_type``'s, on the
  metrics as on the span. No tenant id on a metric: series must not grow with the number of customers.
- Never recorded: an API key or any header but the trace context, a prompt, a completion, a cache salt.
- Off (``engine.tracing.configure`` returned None): the middleware is not installed, the runtime's
  tracer is None, and every helper here returns at once; no span, not even a no-op one, is started.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import context, trace
from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.tracing import extract, mark_error
from engine.usage import Usage
from gateway.errors import GatewayError
from gateway.middleware import request_path_var

# gen_ai.operation.name of each generating path (the Responses API is a chat).
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "chat",
}
# gen_ai.provider.name: what serves the request, as the conventions' server instrumentation names it.
PROVIDER = "tollgate"
_TRACE_HEADERS = (b"traceparent", b"tracestate")
_PARAM = re.compile(r"\{(\w+)\}")
_OFF: contextlib.nullcontext[Span] = contextlib.nullcontext(trace.INVALID_SPAN)


class TracingMiddleware:
    """Pure ASGI (no task per request): the server span is current for the whole call, so the
    generation's spans and the engine call's ``traceparent`` hang under it."""

    def __init__(self, app: ASGIApp, tracer: Tracer, prefix: str = "/v1/") -> None:
        self.app = app
        self.tracer = tracer
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        carrier = {name.decode(): value.decode("latin-1") for name, value in scope["headers"]
                   if name in _TRACE_HEADERS}
        parent = extract(carrier)
        attributes: dict[str, Any] = {"http.request.method": method, "url.path": path,
                                      "url.scheme": scope.get("scheme", "http")}
        request_id = scope.get("state", {}).get("request_id")
        if request_id:
            attributes["tollgate.request.id"] = request_id
        if path in OPERATIONS:
            attributes["gen_ai.operation.name"] = OPERATIONS[path]
        span = self.tracer.start_span(method, context=parent, kind=SpanKind.SERVER, attributes=attributes)
        token = context.attach(trace.set_span_in_context(span, parent))

        async def traced_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    mark_error(span, str(status))
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        except BaseException as exc:
            mark_error(span, type(exc).__qualname__)
            raise
        finally:
            route = route_template(scope)
            if route:
                span.update_name(f"{method} {route}")
                span.set_attribute("http.route", route)
            context.detach(token)
            span.end()


def route_template(scope: Scope) -> str | None:
    """The matched route's template with its full prefix (``/v1/models/{model}``): FastAPI's route
    knows only its own part under an included router's prefix (``/models/{model}``), the path the rest."""
    template = getattr(scope.get("route"), "path_format", None)
    if not template:
        return None
    params = scope.get("path_params") or {}
    concrete = _PARAM.sub(lambda m: str(params.get(m.group(1), m.group(0))), template)
    path = scope.get("path", "")
    return path[: len(path) - len(concrete)] + template if path.endswith(concrete) else None


def child_span(tracer: Tracer | None, name: str, kind: SpanKind = SpanKind.INTERNAL,
               attributes: Mapping[str, Any] | None = None) -> contextlib.AbstractContextManager[Span]:
    """A child of the current span, current while the block runs; an error leaving the block marks it
    (``error.type``: the error's OpenAI code). Tracing off (no tracer): the invalid span, at no cost."""
    if tracer is None:
        return _OFF
    return _child(tracer, name, kind, attributes)


@contextlib.contextmanager
def _child(tracer: Tracer, name: str, kind: SpanKind, attributes: Mapping[str, Any] | None) -> Iterator[Span]:
    with tracer.start_as_current_span(name, kind=kind, attributes=attributes, record_exception=False,
                                      set_status_on_exception=False) as span:
        try:
            yield span
        except BaseException as exc:
            fail(span, exc)
            raise


def current(span: Span | None) -> contextlib.AbstractContextManager[Any]:
    """``span`` current while the block runs (not ended after it); None: nothing to do."""
    if span is None:
        return _OFF
    return trace.use_span(span, record_exception=False, set_status_on_exception=False)


def end(span: Span | None, exc: BaseException | None = None) -> None:
    """End ``span`` (None: nothing to do), failed by ``exc`` when given."""
    if span is not None:
        if exc is not None:
            fail(span, exc)
        span.end()


def fail(span: Span | None, exc: BaseException) -> None:
    """Mark ``span`` failed by ``exc``: ``error.type`` is a ``GatewayError``'s OpenAI code (or type),
    else the exception's class, never its message (a 400's may quote the request). The span's status
    is an error for the gateway's and the engine's failures (5xx), not for the client's (a 400, a 429),
    as OpenTelemetry's HTTP conventions have it."""
    if span is None or not span.is_recording():
        return
    if isinstance(exc, GatewayError):
        span.set_attribute("error.type", error_type(exc))
        if exc.status >= 500:
            span.set_status(StatusCode.ERROR)
    else:
        mark_error(span, error_type(exc))


def error_type(exc: BaseException) -> str:
    """``error.type`` of a failure: a ``GatewayError``'s OpenAI code (or type), else the exception's
    class, never its message (a 400's may quote the request)."""
    if isinstance(exc, GatewayError):
        return exc.code or exc.type
    return type(exc).__qualname__


def current_operation() -> str | None:
    """``gen_ai.operation.name`` of the API request being served (None outside one, or on another path)."""
    return OPERATIONS.get(request_path_var.get())


def set_response_id(response_id: str) -> None:
    """``gen_ai.response.id`` on the request's span: the id the client is answered with."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute("gen_ai.response.id", response_id)


def request_attributes(*, model: str, tenant_id: int, tier: str, max_tokens: int | None, n: int,
                       sampling: Mapping[str, Any]) -> dict[str, Any]:
    """What a generation asked for (no prompt, no stop sequences: they are the tenant's text)."""
    attributes = generation_attributes(model=model, tier=tier)
    attributes["tollgate.tenant.id"] = tenant_id
    if max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = max_tokens
    if n != 1:
        attributes["gen_ai.request.choice.count"] = n
    for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"):
        if sampling.get(name) is not None:
            attributes[f"gen_ai.request.{name}"] = sampling[name]
    return attributes


def generation_attributes(*, model: str, tier: str) -> dict[str, Any]:
    """What a generation's span and its metrics both say of it: who serves it, the model, the tier."""
    return {"gen_ai.provider.name": PROVIDER, "gen_ai.request.model": model, "tollgate.tier": tier}


def metric_attributes(*, operation: str | None, model: str, tier: str) -> dict[str, Any]:
    """A generation's GenAI metric attributes but ``error.type`` (``GenAIMetrics.record`` adds it where the
    conventions have it); ``operation`` None (no API request: a batch line, a background response) leaves
    ``gen_ai.operation.name`` out rather than guess it."""
    attributes = generation_attributes(model=model, tier=tier)
    attributes["gen_ai.response.model"] = model
    if operation is not None:
        attributes["gen_ai.operation.name"] = operation
    return attributes


def result_attributes(*, model: str, usage: Usage, finish_reasons: Mapping[int, str], cost_pico_usd: int,
                      status: str) -> dict[str, Any]:
    """What a finished generation answered and cost (``usage``: what its client was told)."""
    return {
        "gen_ai.response.model": model,
        "gen_ai.response.finish_reasons": [finish_reasons[i] for i in sorted(finish_reasons)],
        "gen_ai.usage.input_tokens": usage.prompt_tokens,
        "gen_ai.usage.output_tokens": usage.completion_tokens,
        "tollgate.usage.cached_tokens": usage.cached_tokens,
        "tollgate.cost.pico_usd": cost_pico_usd,
        "tollgate.status": status,
    }
