"""Migrations take a Postgres advisory lock (``migrations/env.py``): processes that run ``tollgate
migrate`` at the same time (the init containers of a Kubernetes rollout) apply each migration once."""

from __future__ import annotations

import subprocess
import sys

import psycopg

from tests.polling import wait_until
from tollgate import schema

LOCK_ID = int.from_bytes(b"tollgate", "big")


def _revision(url: str) -> str | None:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    return row[0] if row else None


def _waiting_for_lock(url: str) -> int:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchone()
    return int(rows[0])


def test_concurrent_migrations_wait_for_the_lock_and_apply_each_migration_once(new_database):
    """Two processes' migrations start while a third holds the lock: neither applies anything until it is
    released, then both succeed and the schema is at head. (Processes, as in a rollout: Alembic's
    ``context`` is process-global, so two migrations in threads of one process would trample each other.)"""
    head = _revision(new_database)
    schema.downgrade(new_database, "base")
    code = "import sys; from tollgate import schema; schema.upgrade(sys.argv[1])"
    with psycopg.connect(new_database, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (LOCK_ID,))
        migrations = [subprocess.Popen([sys.executable, "-c", code, new_database], stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT) for _ in range(2)]
        try:
            wait_until(lambda: _waiting_for_lock(new_database) >= 2, "both migrations to wait for the lock")
            assert _revision(new_database) is None  # nothing applied while another process holds the lock
            holder.execute("SELECT pg_advisory_unlock(%s)", (LOCK_ID,))
            outputs = [m.communicate(timeout=180)[0] for m in migrations]
        finally:
            for m in migrations:
                m.kill()
    assert [m.returncode for m in migrations] == [0, 0], outputs
    assert _revision(new_database) == head
