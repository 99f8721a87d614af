"""Alembic on real Postgres: the history goes up, down and up again, and matches the ORM models."""

from __future__ import annotations

import psycopg
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, pool

from tollgate import schema
from tollgate.db import to_psycopg_url
from tollgate.models import Base

CONTRACT_COLUMNS = {
    "tenants": {
        "id",
        "name",
        "tier",
        "status",
        "suspended_reason",
        "tpm_limit",
        "rpm_limit",
        "max_concurrency",
        "batch_tpd_limit",
        "monthly_budget_pico_usd",
        "stripe_customer_id",
        "created_at",
    },
    "api_keys": {
        "id",
        "tenant_id",
        "name",
        "prefix",
        "key_hash",
        "scopes",
        "expires_at",
        "revoked_at",
        "last_used_at",
    },
    "prices": {
        "model",
        "effective_from",
        "input",
        "cached_input",
        "output",
        "batch_input",
        "batch_cached_input",
        "batch_output",
    },
    "usage_events": {
        "request_id",
        "tenant_id",
        "api_key_id",
        "model",
        "request_class",
        "tier",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "cost_pico_usd",
        "status",
        "ttft_ms",
        "tpot_ms",
        "created_at",
    },
    "admins": {"id", "email", "password_hash", "api_token_hash", "created_at"},
    "audit_log": {"id", "actor", "action", "tenant_id", "details", "created_at"},
}


def _tables(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'").fetchall()
    return {name for (name,) in rows} - {"alembic_version"}


def test_upgrade_downgrade_upgrade_round_trip(new_database):
    assert CONTRACT_COLUMNS.keys() <= _tables(new_database)
    schema.downgrade(new_database, "base")
    assert _tables(new_database) == set()
    schema.upgrade(new_database)
    assert CONTRACT_COLUMNS.keys() <= _tables(new_database)


def test_contract_columns_and_money_types(new_database):
    engine = create_engine(to_psycopg_url(new_database), poolclass=pool.NullPool)
    try:
        inspector = inspect(engine)
        for table, columns in CONTRACT_COLUMNS.items():
            assert columns <= {c["name"] for c in inspector.get_columns(table)}, table
        money = {c["name"]: str(c["type"]) for c in inspector.get_columns("prices")}
        assert {money[name] for name in CONTRACT_COLUMNS["prices"] - {"model", "effective_from"}} == {
            "BIGINT"
        }
        ledger = {c["name"]: str(c["type"]) for c in inspector.get_columns("usage_events")}
        assert ledger["cost_pico_usd"] == "BIGINT"
        # One ledger row per request id: a unique constraint on usage_events, or (once usage_events is
        # partitioned by month, which forbids it) the primary key of usage_request_ids.
        unique = [set(u["column_names"]) for u in inspector.get_unique_constraints("usage_events")]
        if "usage_request_ids" in inspector.get_table_names():
            unique.append(set(inspector.get_pk_constraint("usage_request_ids")["constrained_columns"]))
        assert {"request_id"} in unique
    finally:
        engine.dispose()


def test_autogenerate_against_the_models_finds_no_difference(database_url):
    engine = create_engine(to_psycopg_url(database_url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"compare_type": True, "compare_server_default": True}
            )
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()


def test_history_is_linear_with_dated_file_names():
    script = ScriptDirectory.from_config(schema.alembic_config())
    assert len(script.get_heads()) == 1
    for revision in script.walk_revisions():
        name = revision.path.rsplit("/", 1)[1]
        assert name[:8].isdigit() and name[8] == "_", name
