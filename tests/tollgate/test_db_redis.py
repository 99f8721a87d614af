"""Unit of work (``Database.session`` and the FastAPI dependency), URL handling, Redis helpers."""

from __future__ import annotations

import httpx
import psycopg
import pytest
from fastapi import FastAPI
from sqlalchemy import text

from tollgate.db import Database, Session, database_url, to_psycopg_url
from tollgate.redis import create_redis, redis_url
from tollgate.settings import Settings


def count(url: str, name: str) -> int:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT count(*) FROM tenants WHERE name = %s", (name,)).fetchone()[0]


async def test_session_commits_on_success_and_rolls_back_on_error(new_database):
    db = Database(new_database, pool_size=2)
    try:
        async with db.session() as session:
            await session.execute(text("INSERT INTO tenants (name) VALUES ('kept')"))
        with pytest.raises(RuntimeError, match="boom"):
            async with db.session() as session:
                await session.execute(text("INSERT INTO tenants (name) VALUES ('dropped')"))
                raise RuntimeError("boom")
    finally:
        await db.dispose()
    assert (count(new_database, "kept"), count(new_database, "dropped")) == (1, 0)


async def test_request_dependency_is_one_unit_of_work(new_database):
    app = FastAPI()
    app.state.db = Database(new_database, pool_size=2)

    @app.post("/tenants/{name}")
    async def create(name: str, session: Session, fail: bool = False) -> dict[str, str]:
        await session.execute(text("INSERT INTO tenants (name) VALUES (:name)"), {"name": name})
        if fail:
            raise RuntimeError("handler failed after writing")
        return {"created": name}

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.post("/tenants/ok")).status_code == 200
            assert (await client.post("/tenants/bad", params={"fail": "true"})).status_code == 500
    finally:
        await app.state.db.dispose()
    assert (count(new_database, "ok"), count(new_database, "bad")) == (1, 0)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://u:p@h:5432/d", "postgresql+psycopg://u:p@h:5432/d"),
        ("postgres://u@h/d", "postgresql+psycopg://u@h/d"),
        ("postgresql+asyncpg://u:p%40x@h/d", "postgresql+psycopg://u:p%40x@h/d"),
    ],
)
def test_urls_are_normalised_to_psycopg(url, expected):
    assert to_psycopg_url(url) == expected


def test_non_postgres_url_is_refused_without_echoing_the_password():
    with pytest.raises(ValueError, match="not a PostgreSQL URL") as info:
        to_psycopg_url("mysql://user:hunter2@h/d")
    assert "hunter2" not in str(info.value)


def test_missing_urls_name_the_variable():
    with pytest.raises(RuntimeError, match="TOLLGATE_DATABASE_URL is not set"):
        database_url(Settings(database_url=None))
    with pytest.raises(RuntimeError, match="TOLLGATE_REDIS_URL is not set"):
        redis_url(Settings(redis_url=None))
    with pytest.raises(ValueError, match="pool_size"):
        Database("postgresql://u@h/d", pool_size=0)


async def test_create_redis_reaches_the_configured_server(service_settings):
    client = create_redis(service_settings, decode_responses=True)
    try:
        await client.set("tollgate:test:db-redis", "v")
        assert await client.get("tollgate:test:db-redis") == "v"
    finally:
        await client.delete("tollgate:test:db-redis")
        await client.aclose()
