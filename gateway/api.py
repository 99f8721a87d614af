"""The public OpenAI-compatible API as a ``gateway.app`` extension module.

- ``install(app)``: the request-context middleware (``x-request-id``, body size limit → 413, last-resort
  500) and the exception handlers that render every error in OpenAI's body. When the ``OTEL_*``
  variables turn traces on (``engine.tracing``), the tracing middleware inside it: a server span per
  ``/v1`` request (``gateway.tracing``), its provider on ``app.state.tracing`` (else None). When they
  turn metrics on (``engine.otel_metrics``), the GenAI server metrics' provider on
  ``app.state.genai_metrics`` (else None). A setting neither can honour stops the app here, at start-up.
- ``router``: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/embeddings``,
  ``/v1/models``, ``/v1/models/{model}``.
- ``lifespan(app)``: builds the process's ``GatewayRuntime`` on the app's shared Redis client and
  database (price book, tokenizers, replica poller, key-invalidation listener, engine HTTP pool, the
  tracer, the GenAI metrics) and stores it on ``app.state.gateway``; stops it on shutdown, then flushes
  the traces and exports the metrics recorded since the last export.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI

from engine.otel_metrics import configure as configure_metrics
from engine.tracing import configure as configure_tracing
from gateway.chat.endpoints import router as chat_router
from gateway.completions.endpoints import router as completions_router
from gateway.deps import GatewayRuntime
from gateway.embeddings.endpoints import router as embeddings_router
from gateway.errors import install_exception_handlers
from gateway.middleware import RequestContextMiddleware, RequestIdLogFilter
from gateway.models.endpoints import router as models_router
from gateway.openai.schemas import OPENAPI_SCHEMAS
from gateway.responses.endpoints import router as responses_router
from gateway.tracing import TracingMiddleware

# Room for the multipart framing around an upload of ``settings.files_max_bytes`` (the files endpoint
# enforces the exact file size); every other body is an API call.
MULTIPART_OVERHEAD_BYTES = 64 * 1024

router = APIRouter(prefix="/v1", tags=["openai"])
router.include_router(chat_router)
router.include_router(completions_router)
router.include_router(embeddings_router)
router.include_router(models_router)
router.include_router(responses_router)


def install(app: FastAPI) -> None:
    _document_request_bodies(app)
    settings = app.state.settings
    tracing = app.state.tracing = configure_tracing("tollgate-gateway")
    app.state.genai_metrics = configure_metrics("tollgate-gateway")
    if tracing is not None:  # inside the request context: its span knows the request id
        app.add_middleware(TracingMiddleware, tracer=tracing.tracer)
    app.add_middleware(RequestContextMiddleware, max_body_bytes=settings.max_request_body_bytes,
                       path_limits={"/v1/files": settings.files_max_bytes + MULTIPART_OVERHEAD_BYTES})
    install_exception_handlers(app)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RequestIdLogFilter) for f in handler.filters):
            handler.addFilter(RequestIdLogFilter())


def _document_request_bodies(app: FastAPI) -> None:
    """Add the request-body schemas the endpoints reference to the OpenAPI document's components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = build()
            spec.setdefault("components", {}).setdefault("schemas", {}).update(OPENAPI_SCHEMAS)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    runtime = GatewayRuntime.create(app.state.settings, app.state.redis, app.state.db.sessionmaker,
                                    resolver=getattr(app.state, "replica_resolver", None))
    tracing = app.state.tracing
    runtime.tracer = None if tracing is None else tracing.tracer
    metrics = runtime.genai_metrics = app.state.genai_metrics
    await runtime.start()
    app.state.gateway = runtime
    # Everything built so far (imports, tokenizers, pydantic schemas: ~150k objects) lives as long as
    # the process: move it out of the collector's sight, so a full collection walks only what requests
    # allocate (one took ~30-60 ms over the whole heap: a p99 spike in benchmarks/gateway_overhead.py).
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        await runtime.stop()
        if tracing is not None:
            await asyncio.to_thread(tracing.shutdown)
        if metrics is not None:
            await asyncio.to_thread(metrics.shutdown)
