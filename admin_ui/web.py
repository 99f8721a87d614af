"""Rendering plumbing shared by the dashboard's views: Jinja2 templates, responses with the session
cookie and security headers, the unit of work for actions, and the handlers for ``LoginRequired`` /
``CsrfRejected``.

Every dashboard response is ``Cache-Control: no-store`` (pages show secrets once and live numbers), may
not be framed, and runs under a Content-Security-Policy that allows only this origin's scripts and
styles: no inline script, so chart data travels in ``<script type="application/json">`` blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.templating import Jinja2Templates
from sqlalchemy.ext.asyncio import AsyncSession
from starlette.responses import RedirectResponse, Response

from admin_ui.session import (
    CSRF_FIELD,
    CsrfRejected,
    LoginRequired,
    SessionState,
    load_session,
    save_session,
)
from gateway.admin.auth import AdminPrincipal
from gateway.admin.schemas import usd_string
from gateway.admin.uow import admin_unit_of_work

PACKAGE_DIR = Path(__file__).resolve().parent
templates = Jinja2Templates(directory=str(PACKAGE_DIR / "templates"))

SECURITY_HEADERS = {
    "cache-control": "no-store",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "content-security-policy": ("default-src 'self'; script-src 'self'; style-src 'self'; "
                                "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; "
                                "form-action 'self'; base-uri 'none'"),
}
NAV = (("Tenants", "/admin/tenants"), ("Usage", "/admin/usage"), ("SLOs & engines", "/admin/engines"),
       ("Prompt cache", "/admin/cache"), ("Batches", "/admin/batches"), ("Prices", "/admin/prices"),
       ("Records", "/admin/db/"))


def _fmt_int(value: int | None) -> str:
    return "—" if value is None else f"{value:,}"


def _fmt_time(value: datetime | None) -> str:
    return "—" if value is None else value.strftime("%Y-%m-%d %H:%M UTC")


def _fmt_usd(pico: int | Decimal | str | None) -> str:
    return "—" if pico is None else "$" + usd_string(int(pico))


def _fmt_share(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _fmt_bytes(value: int) -> str:
    scaled = float(value)
    for unit in ("B", "KiB", "MiB"):
        if scaled < 1024:
            return f"{scaled:,.0f} {unit}" if unit == "B" else f"{scaled:,.1f} {unit}"
        scaled /= 1024
    return f"{scaled:,.1f} GiB"


templates.env.filters.update(num=_fmt_int, when=_fmt_time, usd=_fmt_usd, share=_fmt_share, size=_fmt_bytes)


def _secure(request: Request, response: Response) -> Response:
    response.headers.update(SECURITY_HEADERS)
    save_session(request, response)
    return response


def render(request: Request, template: str, context: Mapping[str, Any], *, status: int = 200,
           admin: AdminPrincipal | None = None) -> Response:
    session: SessionState = load_session(request)
    full = {"request": request, "admin": admin, "csrf_field": CSRF_FIELD, "csrf_token": session.csrf,
            "nav": NAV, "path": request.url.path, **context}
    return _secure(request, templates.TemplateResponse(request, template, full, status_code=status))


def redirect(request: Request, path: str, **query: str | int | None) -> Response:
    """303 See Other to a dashboard path (after a POST, so a reload does not repeat the action)."""
    params = {k: v for k, v in query.items() if v not in (None, "")}
    url = path + ("?" + urlencode(params) if params else "")
    return _secure(request, RedirectResponse(url, status_code=303))


@asynccontextmanager
async def unit_of_work(request: Request) -> AsyncIterator[AsyncSession]:
    """The admin API's unit of work: commit, then publish the cache invalidations services queued."""
    async with admin_unit_of_work(request.app.state.db, request.app.state.redis) as session:
        yield session


def safe_next(path: str | None) -> str:
    """Where to go after login: only a dashboard path on this site (never another host)."""
    if not path or not path.startswith("/admin") or path.startswith("//") or "\\" in path \
            or path.startswith("/admin/v1") or path.startswith("/admin/login"):
        return "/admin"
    return path


def install_handlers(app: FastAPI) -> None:
    async def login_required(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, LoginRequired)
        target = safe_next(exc.next_path)
        return redirect(request, "/admin/login", next=None if target == "/admin" else target)

    async def csrf_rejected(request: Request, exc: Exception) -> Response:
        return render(request, "error.html", {"title": "Request refused",
                                              "message": "The form was not sent from this dashboard session "
                                                         "(missing or stale CSRF token). Reload the page and "
                                                         "try again."}, status=403)

    app.add_exception_handler(LoginRequired, login_required)
    app.add_exception_handler(CsrfRejected, csrf_rejected)
