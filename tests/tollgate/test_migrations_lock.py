"""Migrations take a Postgres advisory lock (``migrations/env.py``): processes that run ``tollgate
migrate`` at the same time (the init containers of a Kubernetes rollout) apply each migration once."""

from __future__ import annotations

import threading

import psycopg

from tests.polling import wait_until
from tollgate import schema

LOCK_ID = int.from_bytes(b"tollgate", "big")


def _revision(url: str) -> str | None:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    return row[0] if row else None


def _waiting_for_lock(url: str) -> bool:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchone()
    return rows[0] > 0


def test_a_migration_waits_for_the_one_holding_the_lock(new_database):
    head = _revision(new_database)
    schema.downgrade(new_database, "base")
    errors: list[BaseException] = []

    def migrate() -> None:
        try:
            schema.upgrade(new_database)
        except BaseException as e:  # reported by the test below
            errors.append(e)

    with psycopg.connect(new_database, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (LOCK_ID,))
        thread = threading.Thread(target=migrate)
        thread.start()
        wait_until(lambda: _waiting_for_lock(new_database), "the migration to wait for the advisory lock")
        assert _revision(new_database) is None  # nothing applied while another process holds the lock
        holder.execute("SELECT pg_advisory_unlock(%s)", (LOCK_ID,))
        thread.join(timeout=120)
    assert not thread.is_alive() and errors == []
    assert _revision(new_database) == head


def test_concurrent_migrations_from_an_empty_database_all_succeed(new_database):
    head = _revision(new_database)
    schema.downgrade(new_database, "base")
    errors: list[BaseException] = []

    def migrate() -> None:
        try:
            schema.upgrade(new_database)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=migrate) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert errors == []
    assert _revision(new_database) == head
