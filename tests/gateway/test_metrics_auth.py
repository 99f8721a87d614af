"""``GET /metrics`` on the public gateway port is for the operator only: a scrape presents the metrics
token (``TOLLGATE_METRICS_TOKEN``, what a Prometheus scrape config carries) or an admin API token;
anything else (no header, a wrong token, a tenant API key) is a 401 in OpenAI's error body, and the
metrics text is never in it. In process (``httpx.ASGITransport``), real Postgres for the admin lookup.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

import gateway.metrics
from gateway.admin import service
from gateway.app import create_app
from tests.factories import create_api_key, create_tenant
from tollgate.db import Database
from tollgate.settings import Settings

METRICS_TOKEN = "prom-scrape-" + "x" * 32


@dataclass
class App:
    app: Any
    admin_token: str
    tenant_key: str


@pytest.fixture(scope="module")
def metrics_database_url(shared_servers: Any) -> Any:
    with shared_servers.migrated_database(f"tollgate_metrics_{uuid.uuid4().hex[:8]}") as url:
        yield url


async def _app(database_url: str, redis_url: str, metrics_token: str | None) -> AsyncIterator[App]:
    settings = Settings(environment="test", database_url=database_url, redis_url=redis_url,
                        metrics_token=SecretStr(metrics_token) if metrics_token else None)
    db = Database(database_url, pool_size=1)
    try:
        async with db.session() as session:
            _, admin_token = await service.create_admin(session, f"ops-{uuid.uuid4().hex[:6]}@example.com",
                                                        settings=settings, actor="test")
            _, tenant_key = await create_api_key(session, await create_tenant(session), settings=settings)
    finally:
        await db.dispose()
    app = create_app(settings, (gateway.metrics,))
    async with app.router.lifespan_context(app):
        yield App(app, admin_token, tenant_key)


@pytest.fixture(scope="module")
async def gw(metrics_database_url: str, redis_url: str) -> AsyncIterator[App]:
    async for app in _app(metrics_database_url, redis_url, METRICS_TOKEN):
        yield app


async def _get(app: App, authorization: str | None) -> httpx.Response:
    headers = {} if authorization is None else {"Authorization": authorization}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app.app), base_url="http://gw") as c:
        return await c.get("/metrics", headers=headers)


def _assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers["www-authenticate"].startswith("Bearer")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert "tollgate_gateway" not in response.text


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Basic dXNlcjpwYXNz", "Bearer wrong",
                                           f"Bearer {METRICS_TOKEN}x", f"Token {METRICS_TOKEN}",
                                           "Bearer tg-admin-" + "A" * 43])
async def test_scrape_without_a_valid_token_is_refused(gw: App, authorization: str | None) -> None:
    _assert_refused(await _get(gw, authorization))


async def test_tenant_key_does_not_open_metrics(gw: App) -> None:
    _assert_refused(await _get(gw, f"Bearer {gw.tenant_key}"))


@pytest.mark.parametrize("which", ["metrics_token", "admin_token"])
async def test_metrics_token_or_admin_token_scrapes(gw: App, which: str) -> None:
    token = METRICS_TOKEN if which == "metrics_token" else gw.admin_token
    response = await _get(gw, f"bearer  {token} ")  # scheme case-insensitive, whitespace tolerated
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    assert "tollgate_gateway_requests_total" in response.text


async def test_without_a_metrics_token_only_admin_tokens_scrape(new_database: str, redis_url: str) -> None:
    async for app in _app(new_database, redis_url, None):
        _assert_refused(await _get(app, "Bearer "))
        _assert_refused(await _get(app, f"Bearer {METRICS_TOKEN}"))
        assert (await _get(app, f"Bearer {app.admin_token}")).status_code == 200
