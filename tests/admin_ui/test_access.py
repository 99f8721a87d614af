"""Without an admin session the dashboard shows nothing but the login page; form posts need the
session's CSRF token; password login with argon2 hashes, lockout, logout and session end."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import select

from tests.admin_ui.conftest import ADMIN_PASSWORD, CSRF_RE, Dashboard, login_client
from tests.factories import create_api_key, create_tenant
from tollgate.models import Admin, Tenant

# Meant for one worker sharing the gateway + engine + browser (pytest -n --dist loadgroup); with pytest 9
# and xdist 3.8 the group is not honoured, so each worker builds its own (slower, still correct).
pytestmark = pytest.mark.xdist_group("admin_ui")

PAGES = ["/admin", "/admin/", "/admin/tenants", "/admin/tenants/1", "/admin/usage", "/admin/usage.csv",
         "/admin/engines", "/admin/engines/live", "/admin/batches", "/admin/prices", "/admin/no-such-page",
         "/admin/db/", "/admin/db/login", "/admin/db/usage-event/list", "/admin/db/audit-log/export/csv"]
ACTIONS = ["/admin/tenants", "/admin/tenants/1/limits", "/admin/tenants/1/suspend", "/admin/tenants/1/keys",
           "/admin/tenants/1/keys/1/revoke", "/admin/prices", "/admin/batches/batch_x/cancel"]


async def _tenant_key(dashboard: Dashboard) -> tuple[Tenant, str]:
    async with dashboard.db.session() as session:
        tenant = await create_tenant(session)
        _, key = await create_api_key(session, tenant, settings=dashboard.settings)
    return tenant, key


@pytest.mark.parametrize("with_tenant_key", [False, True], ids=["anonymous", "tenant-key"])
async def test_without_admin_session_only_the_login_page(dashboard: Dashboard, with_tenant_key: bool) -> None:
    tenant, key = await _tenant_key(dashboard)
    headers = {"Authorization": f"Bearer {key}"} if with_tenant_key else {}
    async with httpx.AsyncClient(base_url=dashboard.url, headers=headers) as client:
        for path in PAGES:
            response = await client.get(path)
            assert response.status_code == 303, path
            assert response.headers["location"].startswith("/admin/login"), path
            assert tenant.name not in response.text
        for path in ACTIONS:
            response = await client.post(path, data={"name": "intruder", "rpm_limit": "0"})
            assert response.status_code in (303, 403), path
            assert "/admin/login" in response.headers.get("location", "/admin/login")
        login = await client.get("/admin/login")
        assert login.status_code == 200 and 'name="password"' in login.text
        assert tenant.name not in login.text
        assert login.headers["cache-control"] == "no-store"
    async with httpx.AsyncClient(base_url=dashboard.url) as fresh:
        cookie = (await fresh.get("/admin/login")).headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=lax" in cookie and "path=/admin" in cookie
    assert "secure" not in cookie  # plain http here; https requests get Secure
    async with dashboard.db.session() as session:
        assert await session.scalar(select(Tenant).where(Tenant.name == "intruder")) is None


async def test_session_cookie_is_secure_over_https(dashboard: Dashboard) -> None:
    transport = httpx.ASGITransport(app=dashboard.app)
    async with httpx.AsyncClient(transport=transport, base_url="https://dashboard.example") as client:
        response = await client.get("/admin/login")
    assert response.status_code == 200
    cookie = response.headers["set-cookie"].lower()
    assert "; secure" in cookie and "httponly" in cookie and "samesite=lax" in cookie


async def test_admin_api_paths_stay_json(dashboard: Dashboard) -> None:
    async with httpx.AsyncClient(base_url=dashboard.url) as client:
        response = await client.get("/admin/v1/no-such-route")
    assert response.status_code == 404 and "error" in response.json()


async def test_csrf_less_form_posts_are_refused(dashboard: Dashboard) -> None:
    async with httpx.AsyncClient(base_url=dashboard.url) as client:
        token = await login_client(dashboard, client)
        refused = [
            {"name": "no-csrf-1"},
            {"name": "no-csrf-2", "csrf_token": ""},
            {"name": "no-csrf-3", "csrf_token": token[:-2] + "xx"},
        ]
        for form in refused:
            response = await client.post("/admin/tenants", data=form)
            assert response.status_code == 403, form
            assert "CSRF" in response.text
        cross_site = await client.post("/admin/tenants", data={"name": "no-csrf-4", "csrf_token": token},
                                       headers={"origin": "https://evil.example"})
        assert cross_site.status_code == 403
        accepted = await client.post("/admin/tenants", data={"name": "with-csrf", "csrf_token": token})
        assert accepted.status_code == 303 and accepted.headers["location"].startswith("/admin/tenants/")
        # Logging out needs the token too, and ends the session.
        assert (await client.post("/admin/logout")).status_code == 403
        assert (await client.get("/admin/tenants")).status_code == 200
        assert (await client.post("/admin/logout", data={"csrf_token": token})).status_code == 303
        assert (await client.get("/admin/tenants")).status_code == 303
    async with dashboard.db.session() as session:
        names = set(await session.scalars(select(Tenant.name).where(Tenant.name.like("%csrf%"))))
    assert names == {"with-csrf"}


async def test_login_needs_csrf_and_the_right_password(dashboard: Dashboard) -> None:
    async with httpx.AsyncClient(base_url=dashboard.url) as client:
        form = {"email": dashboard.admin_email, "password": ADMIN_PASSWORD}
        assert (await client.post("/admin/login", data=form)).status_code == 403
        token = CSRF_RE.search((await client.get("/admin/login")).text)[1]  # type: ignore[index]
        wrong = await client.post("/admin/login", data={**form, "password": "nope", "csrf_token": token})
        assert wrong.status_code == 401 and "Incorrect email or password." in wrong.text
        unknown = await client.post("/admin/login", data={**form, "email": "nobody@example.com",
                                                          "csrf_token": token})
        assert unknown.status_code == 401 and "Incorrect email or password." in unknown.text
        evil_next = await client.post("/admin/login", data={**form, "csrf_token": token,
                                                            "next": "//evil.example/admin"})
        assert evil_next.status_code == 303 and evil_next.headers["location"] == "/admin"
    async with dashboard.db.session() as session:
        stored = await session.scalar(select(Admin.password_hash).where(Admin.email == dashboard.admin_email))
    assert stored is not None and stored.startswith("$argon2id$") and ADMIN_PASSWORD not in stored


async def test_repeated_failures_lock_the_email(dashboard: Dashboard) -> None:
    from gateway.admin import service
    from gateway.admin.uow import admin_unit_of_work

    email = "lockout@example.com"
    async with admin_unit_of_work(dashboard.db, dashboard.redis) as session:
        await service.create_admin(session, email, settings=dashboard.settings, actor="test", password="pw-1")
    async with httpx.AsyncClient(base_url=dashboard.url) as client:
        token = CSRF_RE.search((await client.get("/admin/login")).text)[1]  # type: ignore[index]
        for _ in range(10):
            response = await client.post("/admin/login", data={"email": email, "password": "bad",
                                                                "csrf_token": token})
            assert response.status_code == 401
        locked = await client.post("/admin/login", data={"email": email, "password": "pw-1",
                                                         "csrf_token": token})
        assert locked.status_code == 429 and "Too many failed logins" in locked.text


async def test_changing_the_password_ends_sessions(dashboard: Dashboard) -> None:
    from argon2 import PasswordHasher

    from gateway.admin import service
    from gateway.admin.uow import admin_unit_of_work

    email = "rotating@example.com"
    async with admin_unit_of_work(dashboard.db, dashboard.redis) as session:
        await service.create_admin(session, email, settings=dashboard.settings, actor="test", password="pw-1")
    async with httpx.AsyncClient(base_url=dashboard.url) as client:
        token = CSRF_RE.search((await client.get("/admin/login")).text)[1]  # type: ignore[index]
        ok = await client.post("/admin/login", data={"email": email, "password": "pw-1", "csrf_token": token})
        assert ok.status_code == 303
        assert (await client.get("/admin/prices")).status_code == 200
        async with dashboard.db.session() as session:
            admin = await session.scalar(select(Admin).where(Admin.email == email))
            assert admin is not None
            admin.password_hash = PasswordHasher().hash("pw-2")
        assert (await client.get("/admin/prices")).status_code == 303
