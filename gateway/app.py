"""The gateway's ASGI application, built from the extension modules it is given. Which extensions the
gateway process runs, and in which order, is composed once in ``tollgate.gateway_app`` (the
composition root: ``uvicorn --factory tollgate.gateway_app:create_app``).

Invariants:
- ``app.state.settings``, ``app.state.db`` (``tollgate.db.Database``) and ``app.state.redis`` (asyncio
  Redis) exist for the whole lifespan; clients connect lazily, so the app starts (and ``/health``
  answers 503) while Postgres or Redis is down.
- ``app.state.replica_resolver``, when set before the app starts, resolves the pools' DNS names
  (``gateway.replicas.Resolver``; the tests' fake one). Unset: the system's resolver.
- An extension module may define ``install(app)`` (middleware, exception handlers, mounts),
  ``router`` (an ``APIRouter``) and ``lifespan(app)`` (an async context manager). The order of the
  extensions decides, and only as follows:
  - ``install`` runs once each, in order. Starlette wraps each middleware added around those added
    before, so the *last* installed middleware is the *outermost*; a later exception handler for the
    same exception class replaces an earlier one.
  - Routers are included in order, and the first matching route answers.
  - Lifespans are entered in order, after the shared clients exist, and exited in *reverse* order,
    before the clients close.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from types import ModuleType
from typing import Any

from fastapi import FastAPI

from tollgate.db import Database
from tollgate.redis import create_redis, warn_if_not_durable
from tollgate.settings import Settings, get_settings


def _no_native_telemetry() -> dict[str, Any]:
    """FastAPI's built-in OpenTelemetry hooks, off: Tollgate exports Prometheus metrics and JSON logs,
    and the hooks' per-request check (``get_tracer_provider`` reads the environment) cost ~4% of a
    request's CPU in ``benchmarks/gateway_overhead.py``. FastAPI versions without them take no argument."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


def create_app(settings: Settings | None, extensions: Sequence[ModuleType]) -> FastAPI:
    """The app of ``extensions``, in their order (see the module docstring)."""
    settings = settings or get_settings()
    loaded = list(extensions)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.db = Database.from_settings(settings)
        app.state.redis = create_redis(settings)
        await warn_if_not_durable(app.state.redis)
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
