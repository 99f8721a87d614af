"""Fixtures for the dashboard tests: the whole gateway (public API, batches, admin API and dashboard) on
a real CPU engine with the tiny model, real Postgres and Redis, and Debian's chromium driven by
Playwright.

Started once per test session (by the worker that runs the ``admin_ui`` group) and shared:
- ``dashboard``: the gateway app under uvicorn (``tests.gateway.conftest.run_gateway``) on an engine
  subprocess (``run_engine``), with a database of its own (the app commits) and a Redis database index of
  its own (``REDIS_INDEX_BASE`` - worker index), so no other test's outbox entries or ``flushdb`` meet it.
  One admin with a password exists: ``dashboard.admin_email`` / ``ADMIN_PASSWORD``.
  Its settings also list a ``batch`` pool with one replica that is down.
- ``browser``: headless chromium (``/usr/bin/chromium``; never ``playwright install``).
- ``page``: a fresh browser context and page per test (no shared cookies).
Screenshots go to ``test-artifacts/screenshots/`` (gitignored) through ``screenshot(page, name)``.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.factories import create_price
from tests.gateway.conftest import MODEL, gateway_settings, run_engine, run_gateway
from tollgate.db import Database
from tollgate.local_services import free_port
from tollgate.settings import PoolConfig

ADMIN_PASSWORD = "correct horse battery staple"
REDIS_INDEX_BASE = 63
BATCH_REPLICA = "http://127.0.0.1:{port}"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots"


@dataclass
class Dashboard:
    url: str
    app: Any
    db: Database
    redis: Redis
    admin_email: str

    @property
    def settings(self) -> Any:
        return self.app.state.settings


@pytest.fixture(scope="session")
def dashboard_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny import create_tiny_checkpoint

    return create_tiny_checkpoint(tmp_path_factory.mktemp("admin_ui_tiny"), arch="llama", seed=0)


@pytest.fixture(scope="session")
def dashboard_adapter_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The adapter store the dashboard's gateway writes and its engine serves (``--lora-dir``)."""
    return tmp_path_factory.mktemp("admin_ui_adapters")


@pytest.fixture(scope="session")
def dashboard_engine(dashboard_tiny_model: Path, dashboard_adapter_store: Path,
                     tmp_path_factory: pytest.TempPathFactory) -> Any:
    log = tmp_path_factory.mktemp("admin_ui_engine") / "engine.log"
    options = ("--num-kv-blocks", "512", "--max-loras", "2", "--lora-dir", str(dashboard_adapter_store))
    with run_engine(dashboard_tiny_model, log, options=options) as (url, _):
        yield url


@pytest.fixture(scope="session")
def dashboard_database(shared_servers: Any) -> Any:
    name = f"tollgate_admin_ui_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}_{uuid.uuid4().hex[:6]}"
    with shared_servers.migrated_database(name) as url:
        yield url


@pytest.fixture(scope="session")
def dashboard_redis_url(shared_servers: Any) -> str:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw-1")
    index = REDIS_INDEX_BASE - (int(worker.removeprefix("gw")) + 1 if worker.startswith("gw") else 0)
    return shared_servers.redis.url(index)


@pytest.fixture(scope="session")
async def dashboard(dashboard_engine: str, dashboard_tiny_model: Path, dashboard_database: str,
                    dashboard_redis_url: str, dashboard_adapter_store: Path) -> AsyncIterator[Dashboard]:
    from gateway.admin import service
    from gateway.admin.uow import admin_unit_of_work

    redis = Redis.from_url(dashboard_redis_url)
    await redis.flushdb()
    settings = gateway_settings([dashboard_engine], dashboard_tiny_model, dashboard_database,
                                dashboard_redis_url)
    # A batch pool whose only replica is down: the engines page probes pools the router does not own.
    settings.pools["batch"] = PoolConfig(replicas=[BATCH_REPLICA.format(port=free_port())])
    settings.adapter_dir = dashboard_adapter_store
    email = f"ops-{uuid.uuid4().hex[:6]}@example.com"
    db = Database(dashboard_database, pool_size=1)
    async with db.session() as session:
        await create_price(session, model=MODEL)
    await db.dispose()
    async with run_gateway(settings) as running:
        async with admin_unit_of_work(running.db, redis) as session:
            await service.create_admin(session, email, settings=settings, actor="test",
                                       password=ADMIN_PASSWORD)
        yield Dashboard(running.url, running.app, running.db, redis, email)
    await redis.aclose()


@pytest.fixture(scope="session")
async def browser() -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        await chromium.close()


@pytest.fixture
async def page(browser: Any, dashboard: Dashboard) -> AsyncIterator[Any]:
    context = await browser.new_context(base_url=dashboard.url, viewport={"width": 1400, "height": 1000})
    page = await context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    # Script errors, and any dashboard asset that fails to load (deliberate 401/404 pages are not assets).
    page.on("console", lambda msg: errors.append(msg.text)
            if msg.type == "error" and not msg.text.startswith("Failed to load resource") else None)
    page.on("response", lambda response: errors.append(f"{response.status} {response.url}")
            if "/admin/static/" in response.url and response.status >= 400 else None)
    yield page
    await context.close()
    assert not errors, f"browser errors: {errors}"


async def screenshot(page: Any, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


CSRF_RE = re.compile(r'name="csrf_token" value="([^"]+)"')


async def login_client(dashboard: Dashboard, client: httpx.AsyncClient) -> str:
    """Log ``client`` in with the form (as a browser would); returns the session's CSRF token."""
    page = await client.get("/admin/login")
    token = CSRF_RE.search(page.text)
    assert token is not None
    response = await client.post("/admin/login", data={"csrf_token": token[1], "email": dashboard.admin_email,
                                                       "password": ADMIN_PASSWORD, "next": "/admin/tenants"})
    assert response.status_code == 303 and response.headers["location"] == "/admin/tenants"
    tenants = await client.get("/admin/tenants")
    assert tenants.status_code == 200
    found = CSRF_RE.search(tenants.text)
    assert found is not None
    return found[1]
