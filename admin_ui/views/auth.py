"""Login, logout, the dashboard's home, and the catch-all that keeps unknown ``/admin`` paths from
telling an anonymous visitor anything but "log in"."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from admin_ui.session import (
    CurrentAdmin,
    LoginFailed,
    LoginRequired,
    authenticate_password,
    check_csrf,
    current_admin,
    end_session,
    load_session,
)
from admin_ui.web import redirect, render, safe_next
from gateway.errors import NotFoundError

router = APIRouter(prefix="/admin")


@router.get("", include_in_schema=False)
@router.get("/", include_in_schema=False)
async def home(request: Request, admin: CurrentAdmin) -> Response:
    return redirect(request, "/admin/tenants")


@router.get("/login", include_in_schema=False)
async def login_page(request: Request, next: Annotated[str | None, Query(max_length=512)] = None) -> Response:
    state = load_session(request)
    if state.admin_id is not None:
        try:
            await current_admin(request)
            return redirect(request, safe_next(next))
        except LoginRequired:
            pass
    return render(request, "login.html", {"next": safe_next(next), "email": "", "error": None})


@router.post("/login", include_in_schema=False)
async def login(request: Request) -> Response:
    fields = await check_csrf(request)
    email, target = fields.get("email", ""), safe_next(fields.get("next"))
    try:
        await authenticate_password(request, email, fields.get("password", ""))
    except LoginFailed as exc:
        return render(request, "login.html", {"next": target, "email": email, "error": exc.message},
                      status=exc.status)
    return redirect(request, target)


@router.post("/logout", include_in_schema=False)
async def logout(request: Request) -> Response:
    await check_csrf(request)
    end_session(request)
    return redirect(request, "/admin/login")


# Included last (see ``admin_ui.extension``): unknown dashboard paths. The admin API keeps its own JSON
# 404s; everyone else must log in before learning whether a page exists.
catch_all = APIRouter(prefix="/admin")


@catch_all.get("/{path:path}", include_in_schema=False)
async def not_found(path: str, request: Request) -> Response:
    if path == "v1" or path.startswith("v1/"):
        raise NotFoundError(f"Unknown admin API route /admin/{path}.")
    admin = await current_admin(request)
    return render(request, "error.html", {"title": "Not found", "message": f"No page /admin/{path}."},
                  status=404, admin=admin)
