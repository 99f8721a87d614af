"""Alembic environment: the URL comes from the Alembic config when a caller set one
(``tollgate.schema``), else from ``TOLLGATE_DATABASE_URL`` through the settings; the target metadata is
``tollgate.models.Base.metadata``, so autogenerate compares against the ORM models.

Online runs on Postgres hold a transaction-scoped advisory lock (``MIGRATION_LOCK_ID``) from before
Alembic reads the current revision until the migrations commit. Processes that migrate at once (every
gateway, worker and beat pod of a Kubernetes rollout runs ``tollgate migrate`` first) thus run each
migration once: the others wait, then find the schema at head and do nothing."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection, create_engine, pool, text

from tollgate.db import database_url, to_psycopg_url
from tollgate.models import Base
from tollgate.settings import get_settings

config = context.config
if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata

# "tollgate" as a big-endian int64: the key of the advisory lock that serialises migrations.
MIGRATION_LOCK_ID = int.from_bytes(b"tollgate", "big")


def _url() -> str:
    configured = config.get_main_option("sqlalchemy.url")
    return to_psycopg_url(configured) if configured else database_url(get_settings())


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


def _run_locked(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, compare_type=True)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": MIGRATION_LOCK_ID})
        context.run_migrations()


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        _run_locked(connectable)
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            _run_locked(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
