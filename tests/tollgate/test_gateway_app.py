"""The gateway's composition (``tollgate.gateway_app``) and what an extension's position decides
(``gateway.app``): middleware nesting, route precedence, lifespan order, and the drain order that
billing depends on (in-flight requests settle before the runtime they need stops)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from types import ModuleType

import httpx
from fastapi import APIRouter, FastAPI

import admin_ui.extension
import gateway.api
import gateway.metrics
from gateway.app import create_app as build
from tests.polling import eventually
from tollgate.gateway_app import EXTENSIONS, create_app
from tollgate.settings import Settings


def _extension(name: str, events: list[str], *, path: str | None = None) -> ModuleType:
    """An extension module that records what the app does with it."""
    module = ModuleType(f"ext_{name}")

    def install(app: FastAPI) -> None:
        events.append(f"install {name}")

        @app.middleware("http")
        async def record(request, call_next):  # noqa: ANN001, ANN202
            events.append(f"middleware {name}")
            return await call_next(request)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        events.append(f"enter {name}")
        yield
        events.append(f"exit {name}")

    router = APIRouter()

    @router.get(path or f"/{name}")
    async def answer() -> dict[str, str]:
        return {"answered_by": name}

    module.install, module.lifespan, module.router = install, lifespan, router
    return module


async def test_an_extensions_position_decides_nesting_precedence_and_lifespan_order():
    events: list[str] = []
    first, second = _extension("first", events, path="/shared"), _extension("second", events, path="/shared")
    # Clients connect lazily: nothing here reaches these addresses.
    unused = Settings(environment="test", database_url="postgresql://t@127.0.0.1:9/t",
                      redis_url="redis://127.0.0.1:9")
    app = build(unused, [first, second])
    assert events == ["install first", "install second"]
    async with app.router.lifespan_context(app):
        assert events[-2:] == ["enter first", "enter second"]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.get("/shared")
        # The first router that matches answers; the last installed middleware is the outermost.
        assert response.json() == {"answered_by": "first"}
        assert events[-2:] == ["middleware second", "middleware first"]
    assert events[-2:] == ["exit second", "exit first"]


def test_the_composition_puts_the_drain_before_the_runtime_stop_and_the_dashboard_last():
    assert EXTENSIONS.index(gateway.api) < EXTENSIONS.index(gateway.metrics)
    assert EXTENSIONS[-1] is admin_ui.extension
    assert len(set(EXTENSIONS)) == len(EXTENSIONS)
    app = create_app(Settings(environment="test"))
    # Starlette lists user middleware outermost first.
    order = [m.cls.__name__ for m in app.user_middleware]
    assert order.index("MetricsMiddleware") < order.index("RequestContextMiddleware")


async def test_shutdown_lets_in_flight_requests_settle_before_the_runtime_stops(new_database, redis_url):
    """The whole app's lifespan on real Postgres and Redis: with a request in flight, shutdown waits
    (metrics' drain) and the gateway runtime (engine client, admission, outbox) stops only after it."""
    app = create_app(Settings(environment="test", database_url=new_database, redis_url=redis_url))
    events: list[str] = []
    lifespan = app.router.lifespan_context(app)
    await lifespan.__aenter__()
    runtime, in_flight = app.state.gateway, app.state.in_flight
    real_stop, real_wait_idle = runtime.stop, in_flight.wait_idle

    async def stop() -> None:
        events.append("runtime stopped")
        await real_stop()

    async def wait_idle(timeout: float) -> bool:
        events.append("draining")
        return await real_wait_idle(timeout)

    runtime.stop, in_flight.wait_idle = stop, wait_idle
    in_flight.enter()  # a request the middleware is tracking (a stream, say)
    shutdown = asyncio.create_task(lifespan.__aexit__(None, None, None))
    await eventually(lambda: "draining" in events, "the shutdown to start draining")
    assert events == ["draining"] and not shutdown.done()
    events.append("request settled")
    in_flight.exit()
    await asyncio.wait_for(shutdown, 60)
    assert events == ["draining", "request settled", "runtime stopped"]
