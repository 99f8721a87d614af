"""Database access: async SQLAlchemy 2 on psycopg 3.

Invariants:
- One unit of work per request or task: ``Database.session()`` (and the FastAPI dependency
  ``get_session``) yields a session, commits when the block exits normally and rolls back when it
  raises. Services and repositories never commit.
- URLs are accepted as ``postgresql://`` (what operators and ``psql`` use) and normalised to the
  ``postgresql+psycopg://`` driver here, so the rest of the code never spells a driver.
- A ``Database`` owns its engine; whoever creates one disposes it (the gateway in its lifespan, the CLI
  and Celery tasks in a ``with`` block).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Annotated

import orjson
from fastapi import Depends, Request
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from tollgate.settings import Settings

_DRIVERLESS = {"postgres", "postgresql", "postgresql+psycopg", "postgresql+psycopg2", "postgresql+asyncpg"}


def to_psycopg_url(url: str) -> str:
    """Return ``url`` with the psycopg 3 driver (works for both sync and async engines)."""
    parsed = make_url(url)
    if parsed.drivername not in _DRIVERLESS:
        raise ValueError(f"not a PostgreSQL URL: {parsed.render_as_string(hide_password=True)}")
    return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def database_url(settings: Settings) -> str:
    """The configured database URL (psycopg driver), or a clear error when there is none."""
    if not settings.database_url:
        raise RuntimeError(
            "TOLLGATE_DATABASE_URL is not set (e.g. postgresql://user:pass@host:5432/tollgate);"
            " `tollgate up` sets it for the processes it starts"
        )
    return to_psycopg_url(settings.database_url)


@asynccontextmanager
async def unit_of_work(sessionmaker: async_sessionmaker[AsyncSession]) -> AsyncIterator[AsyncSession]:
    """A session from ``sessionmaker`` that commits when the block exits normally and rolls back when it
    raises."""
    async with sessionmaker() as session:
        try:
            yield session
        except BaseException:
            await session.rollback()
            raise
        await session.commit()


def _json_text(value: object) -> str:
    return orjson.dumps(value).decode()


class Database:
    """An async engine plus its session factory."""

    def __init__(self, url: str, *, pool_size: int = 10, echo: bool = False) -> None:
        if pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {pool_size}")
        self.engine: AsyncEngine = create_async_engine(
            to_psycopg_url(url), pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True, echo=echo,
            json_serializer=_json_text,  # JSONB values (stored responses, batch lines) encoded by orjson
        )
        self.sessionmaker: async_sessionmaker[AsyncSession] = async_sessionmaker(
            self.engine, expire_on_commit=False
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> Database:
        return cls(database_url(settings), pool_size=settings.database_pool_size)

    def session(self) -> AbstractAsyncContextManager[AsyncSession]:
        """Unit of work: commit on normal exit, roll back on error."""
        return unit_of_work(self.sessionmaker)

    async def ping(self) -> None:
        """Run ``SELECT 1``; raises when the database cannot be reached."""
        async with self.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))

    async def dispose(self) -> None:
        await self.engine.dispose()


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    """FastAPI dependency: the request's unit of work on ``app.state.db``."""
    db: Database = request.app.state.db
    async with db.session() as session:
        yield session


Session = Annotated[AsyncSession, Depends(get_session)]
