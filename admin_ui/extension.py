"""The dashboard as a ``gateway.app`` extension module (listed in ``tollgate.gateway_app.EXTENSIONS``).

- ``install(app)``: serves ``admin_ui/static`` (our stylesheet and script, plus the vendored Pico CSS and
  Chart.js with their licenses; nothing is fetched from a CDN) under ``/admin/static``, and registers
  the handlers that turn ``LoginRequired`` into a redirect to ``/admin/login`` and ``CsrfRejected`` into
  a 403 page.
- ``install(app)`` also mounts the read-only sqladmin record browser (``admin_ui.records``) at
  ``/admin/db``, behind the same login; ``lifespan(app)`` binds its sessions to the app's database.
- ``router``: the pages under ``/admin`` (login, tenants and keys, usage, SLOs and engines, prompt
  cache, batches, prices), and last a catch-all so that an unknown dashboard path says "log in" to an
  anonymous visitor. The admin API (``/admin/v1``, ``gateway.admin``) is a separate extension with token
  auth; this one never answers under ``/admin/v1``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI
from fastapi.staticfiles import StaticFiles

from admin_ui.records import bind_records, install_records
from admin_ui.views import adapters, auth, batches, cache, engines, prices, tenants, usage
from admin_ui.web import PACKAGE_DIR, install_handlers

__all__ = ["install", "lifespan", "router"]

router = APIRouter(include_in_schema=False)
for module in (auth, tenants, adapters, usage, engines, cache, batches, prices):
    router.include_router(module.router)
router.include_router(auth.catch_all)


def install(app: FastAPI) -> None:
    app.mount("/admin/static", StaticFiles(directory=PACKAGE_DIR / "static"), name="admin-static")
    install_handlers(app)
    app.state.admin_records_sessions = install_records(app)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    bind_records(app.state.admin_records_sessions, app)
    yield
