"""``tollgate admins create|rotate-token|set-password|delete|list`` against a database of their own (the
commands commit): the printed token opens the admin API, only hashes are stored, and the argon2 password
hash the dashboard will check is written when ``TOLLGATE_ADMIN_PASSWORD`` is set; a password can be
changed or removed, and a deleted admin's token stops working."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from argon2 import PasswordHasher
from click.testing import CliRunner
from sqlalchemy import select

import gateway.admin
from gateway.admin.auth import authenticate_admin_token, hash_admin_token
from gateway.app import create_app
from tollgate.cli import main
from tollgate.db import Database
from tollgate.models import Admin, AuditLog
from tollgate.settings import get_settings


@pytest.fixture
def cli(service_settings, new_database, monkeypatch):
    monkeypatch.setenv("TOLLGATE_DATABASE_URL", new_database)
    monkeypatch.delenv("TOLLGATE_ADMIN_PASSWORD", raising=False)
    get_settings.cache_clear()
    runner = CliRunner()

    def invoke(*args: str, input: str | None = None) -> Any:
        return runner.invoke(main, list(args), input=input, catch_exceptions=False)

    yield invoke
    get_settings.cache_clear()


def rows(query: Any) -> list[Any]:
    async def run() -> list[Any]:
        db = Database.from_settings(get_settings())
        try:
            async with db.session() as session:
                return list((await session.scalars(query)).all())
        finally:
            await db.dispose()

    return asyncio.run(run())


def admin_api_status(token: str) -> int:
    async def run() -> int:
        app = create_app(get_settings(), (gateway.admin,))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway",
                                         headers={"Authorization": f"Bearer {token}"}) as client:
                return (await client.get("/admin/v1/tenants")).status_code

    return asyncio.run(run())


def test_create_prints_a_token_that_opens_the_admin_api(cli) -> None:
    result = cli("admins", "create", "Ops@Example.com")
    assert result.exit_code == 0, result.output
    token = result.output.strip().splitlines()[-1]
    assert token.startswith("tg-admin-") and "shown only once" in result.output
    assert admin_api_status(token) == 200
    assert admin_api_status(token[:-1] + ("a" if token[-1] != "a" else "b")) == 401

    [admin] = rows(select(Admin))
    assert admin.email == "ops@example.com" and admin.password_hash is None
    assert admin.api_token_hash == hash_admin_token(token, get_settings()) and token not in str(vars(admin))
    [entry] = rows(select(AuditLog))
    assert (entry.action, entry.actor.startswith("cli"), entry.details["email"]) == (
        "admin.create", True, "ops@example.com")


def test_password_from_the_environment_is_stored_as_argon2(cli, monkeypatch) -> None:
    monkeypatch.setenv("TOLLGATE_ADMIN_PASSWORD", "correct horse battery staple")
    result = cli("admins", "create", "dash@example.com")
    assert result.exit_code == 0, result.output
    [admin] = rows(select(Admin).where(Admin.email == "dash@example.com"))
    assert admin.password_hash.startswith("$argon2")
    assert PasswordHasher().verify(admin.password_hash, "correct horse battery staple")
    assert "correct horse" not in result.output
    assert "password" in cli("admins", "list").output


def test_password_is_prompted_for_when_the_environment_has_none(cli) -> None:
    result = cli("admins", "create", "prompted@example.com", "--prompt-password",
                 input="s3cret pass\ns3cret pass\n")
    assert result.exit_code == 0, result.output
    [admin] = rows(select(Admin).where(Admin.email == "prompted@example.com"))
    assert PasswordHasher().verify(admin.password_hash, "s3cret pass")
    assert result.output.strip().splitlines()[-1].startswith("tg-admin-")


def test_duplicate_and_malformed_emails_are_clean_errors(cli) -> None:
    assert cli("admins", "create", "a@example.com").exit_code == 0
    duplicate = cli("admins", "create", "A@example.com")
    assert duplicate.exit_code == 1 and "already exists" in duplicate.output
    malformed = cli("admins", "create", "not-an-email")
    assert malformed.exit_code == 1 and "not an email address" in malformed.output
    assert len(rows(select(Admin))) == 1


def test_rotate_token_replaces_the_old_one(cli) -> None:
    old = cli("admins", "create", "rot@example.com").output.strip().splitlines()[-1]
    result = cli("admins", "rotate-token", "rot@example.com")
    assert result.exit_code == 0, result.output
    new = result.output.strip().splitlines()[-1]
    assert new != old and new.startswith("tg-admin-")
    assert admin_api_status(new) == 200 and admin_api_status(old) == 401
    assert cli("admins", "rotate-token", "nobody@example.com").exit_code == 1


def test_set_password_changes_or_removes_the_dashboard_password(cli, monkeypatch) -> None:
    cli("admins", "create", "pw@example.com")
    monkeypatch.setenv("TOLLGATE_ADMIN_PASSWORD", "correct horse")
    result = cli("admins", "set-password", "pw@example.com")
    assert result.exit_code == 0 and "set" in result.output, result.output
    [admin] = rows(select(Admin).where(Admin.email == "pw@example.com"))
    assert PasswordHasher().verify(admin.password_hash, "correct horse")
    removed = cli("admins", "set-password", "pw@example.com", "--remove")
    assert removed.exit_code == 0 and "removed" in removed.output
    [admin] = rows(select(Admin).where(Admin.email == "pw@example.com"))
    assert admin.password_hash is None
    assert cli("admins", "set-password", "nobody@example.com").exit_code == 1
    actions = [a.action for a in rows(select(AuditLog).order_by(AuditLog.id))]
    assert actions.count("admin.set_password") == 2


def test_delete_ends_the_admins_token(cli) -> None:
    token = cli("admins", "create", "gone@example.com").output.strip().splitlines()[-1]
    assert admin_api_status(token) == 200
    refused = cli("admins", "delete", "gone@example.com", input="n\n")
    assert refused.exit_code == 1 and admin_api_status(token) == 200  # not confirmed: nothing changes
    result = cli("admins", "delete", "gone@example.com", "--yes")
    assert result.exit_code == 0 and "deleted admin" in result.output
    assert admin_api_status(token) == 401
    assert rows(select(Admin).where(Admin.email == "gone@example.com")) == []
    assert "admin.delete" in [a.action for a in rows(select(AuditLog))]
    assert cli("admins", "delete", "gone@example.com", "--yes").exit_code == 1


async def test_token_lookup_ignores_malformed_tokens(db_session, settings) -> None:
    assert await authenticate_admin_token(db_session, "sk-tg-not-an-admin-token", settings) is None
    assert await authenticate_admin_token(db_session, "tg-admin-" + "x" * 43, settings) is None
