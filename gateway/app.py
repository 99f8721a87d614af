"""The gateway's ASGI application factory (``uvicorn --factory gateway.app:create_app``).

Invariants:
- ``app.state.settings``, ``app.state.db`` (``tollgate.db.Database``) and ``app.state.redis`` (asyncio
  Redis) exist for the whole lifespan; clients connect lazily, so the app starts (and ``/health``
  answers 503) while Postgres or Redis is down.
- Features plug in as *extension modules*, listed in ``EXTENSIONS``; each may define ``install(app)``
  (middleware, exception handlers; called once at creation), ``router`` (an ``APIRouter``) and
  ``lifespan(app)`` (an async context manager entered after the shared clients exist and exited, in
  reverse order, before they close). Adding a feature is one line in ``EXTENSIONS``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from types import ModuleType
from typing import Any

from fastapi import FastAPI

from tollgate.db import Database
from tollgate.redis import create_redis
from tollgate.settings import Settings, get_settings

EXTENSIONS: tuple[str, ...] = (
    "gateway.health",
    "gateway.api",
    "gateway.metrics",
    "gateway.files.endpoints",
    "gateway.batches.endpoints",
    "gateway.admin",
    "gateway.usage",
    "billing.webhooks",
    "admin_ui.extension",
)


def _load_extensions(names: tuple[str, ...]) -> list[ModuleType]:
    return [importlib.import_module(name) for name in names]


def _no_native_telemetry() -> dict[str, Any]:
    """FastAPI's built-in OpenTelemetry hooks, off: Tollgate exports Prometheus metrics and JSON logs,
    and the hooks' per-request check (``get_tracer_provider`` reads the environment) cost ~4% of a
    request's CPU in ``benchmarks/gateway_overhead.py``. FastAPI versions without them take no argument."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


def create_app(settings: Settings | None = None, *, extensions: tuple[str, ...] | None = None) -> FastAPI:
    """The app with ``EXTENSIONS`` (or only the ``extensions`` given, e.g. to test one in isolation)."""
    settings = settings or get_settings()
    loaded = _load_extensions(EXTENSIONS if extensions is None else extensions)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.db = Database.from_settings(settings)
        app.state.redis = create_redis(settings)
        try:
            async with AsyncExitStack() as stack:
                for extension in loaded:
                    if hasattr(extension, "lifespan"):
                        await stack.enter_async_context(extension.lifespan(app))
                yield
        finally:
            await app.state.redis.aclose()
            await app.state.db.dispose()

    app = FastAPI(title="Tollgate", version="0.1.0", lifespan=lifespan, **_no_native_telemetry())
    app.state.settings = settings
    for extension in loaded:
        if hasattr(extension, "install"):
            extension.install(app)
        if hasattr(extension, "router"):
            app.include_router(extension.router)
    return app
