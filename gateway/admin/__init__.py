"""The admin API (``/admin/v1``) as a ``gateway.app`` extension module, and the admin services the
dashboard and ``tollgate admins`` share.

Files: ``endpoints.py`` (thin routes), ``service.py`` (logic: plain async functions over a session),
``repository.py`` (queries), ``schemas.py`` (pydantic), ``auth.py`` (admin tokens + the dependency),
``uow.py`` (the unit of work that commits, then publishes cache invalidations).

- ``install(app)``: the exception handlers that render every error as ``{"error": {...}}`` (the same
  ones ``gateway.api`` installs; installing them twice is harmless), so the admin API answers in that
  body shape even when it runs without the public API.
- ``router``: the admin routes; each needs an admin token (tenant API keys get 403).
"""

from __future__ import annotations

from fastapi import FastAPI

from gateway.admin.endpoints import router
from gateway.errors import install_exception_handlers

__all__ = ["install", "router"]


def install(app: FastAPI) -> None:
    install_exception_handlers(app)
