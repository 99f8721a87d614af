"""``GET /health`` of the gateway app: 200 when Postgres and Redis answer, 503 naming Redis when it does
not, 200 ``degraded`` naming Postgres when only it does not (it is not on the request path)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

import gateway.health
from gateway.app import create_app
from tollgate.gateway_app import EXTENSIONS
from tollgate.local_services import free_port
from tollgate.settings import Settings


@asynccontextmanager
async def client_for(settings: Settings, *, only_health: bool = False) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings, (gateway.health,) if only_health else EXTENSIONS)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            yield client


async def test_health_is_ok_when_postgres_and_redis_answer(service_settings):
    async with client_for(service_settings) as client:
        response = await client.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok",
                               "components": {"postgres": {"status": "ok"}, "redis": {"status": "ok"}}}


async def test_stopped_redis_makes_health_503_naming_redis(service_settings, private_redis):
    settings = service_settings.model_copy(update={"redis_url": private_redis.url})
    async with client_for(settings) as client:
        assert (await client.get("/health")).status_code == 200
        private_redis.stop()
        response = await client.get("/health")
    body = response.json()
    assert response.status_code == 503
    assert body["failing"] == ["redis"]
    assert body["components"]["postgres"] == {"status": "ok"}
    assert body["components"]["redis"]["status"] == "error" and body["components"]["redis"]["error"]
    assert private_redis.server.password not in response.text


async def test_unreachable_postgres_leaves_a_gateway_with_its_prices_ready_but_degraded(service_settings):
    # The health extension alone, as it answers once Postgres goes away under a running gateway. One that
    # has its price book cached serves without Postgres: still ready (readiness must not empty the Service
    # during a database blip), degraded, naming Postgres. One that never loaded it serves nothing: 503
    # (tests/gateway/test_database_outage_startup.py starts a real one in an outage).
    from types import SimpleNamespace

    dead = f"postgresql://tollgate:secret-pw@127.0.0.1:{free_port()}/tollgate"
    settings = service_settings.model_copy(update={"database_url": dead})
    app = create_app(settings, (gateway.health,))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://g") as client:
            for loaded, status, code in ((True, "degraded", 200), (False, "unavailable", 503)):
                app.state.gateway = SimpleNamespace(prices=SimpleNamespace(loaded=loaded))
                response = await client.get("/health")
                assert response.status_code == code
                assert response.json()["status"] == status and response.json()["failing"] == ["postgres"]
                assert "secret-pw" not in response.text
    assert "secret-pw" not in response.text
