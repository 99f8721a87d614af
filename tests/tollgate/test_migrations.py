"""Alembic on real Postgres: the history goes up, down and up again, and matches the ORM models."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, pool

from billing.partitions import ensure_usage_partitions
from tollgate import schema
from tollgate.db import Database, to_psycopg_url
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
        "cache_write",
        "cache_pin",
        "cache_retention",
        "batch_cache_write",
        "batch_cache_pin",
        "batch_cache_retention",
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
        "cache_write_tokens",
        "cache_pinned_tokens",
        "cache_retained_tokens",
        "cached_host_tokens",
        "cached_disk_tokens",
        "accepted_prediction_tokens",
        "rejected_prediction_tokens",
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


CACHE_PRICES = ("cache_write", "cache_pin", "cache_retention")
CACHE_TOKENS = ("cache_write_tokens", "cache_pinned_tokens", "cache_retained_tokens")


def _columns(conn: psycopg.Connection, table: str, schema_name: str = "public") -> set[str]:
    rows = conn.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_schema = %s AND table_name = %s",
        (schema_name, table),
    ).fetchall()
    return {name for (name,) in rows}


def _attach_march_partition(conn: psycopg.Connection, year: int) -> None:
    """A monthly ledger partition for March of ``year``, made the way billing.partitions makes them."""
    conn.execute(
        f"CREATE TABLE usage_partitions.usage_events_{year}_03"
        " (LIKE usage_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
    )
    conn.execute(
        f"ALTER TABLE usage_events ATTACH PARTITION usage_partitions.usage_events_{year}_03"
        f" FOR VALUES FROM ('{year}-03-01T00:00:00+00:00') TO ('{year}-04-01T00:00:00+00:00')"
    )


def _insert_ledger_row(conn: psycopg.Connection, request_id: str, tenant_id: int, model: str,
                       at: datetime) -> None:  # fmt: skip
    """A completed ledger row of 100 prompt and 5 completion tokens, as written before the migration."""
    conn.execute(
        "INSERT INTO usage_events (request_id, tenant_id, model, request_class, tier, prompt_tokens,"
        " cached_tokens, completion_tokens, cost_pico_usd, status, created_at)"
        " VALUES (%s, %s, %s, 'interactive', 'default', 100, 0, 5, 375, 'completed', %s)",
        (request_id, tenant_id, model, at),
    )


def _insert_hourly_rollup(conn: psycopg.Connection, tenant_id: int, model: str, hour: datetime) -> None:
    """One interactive hour of ``model``: 1 request, 100 input and 5 output tokens, 375 pico-USD."""
    conn.execute(
        "INSERT INTO usage_hourly (tenant_id, hour, model, request_class, requests, input_tokens,"
        " cached_input_tokens, output_tokens, input_cost_pico_usd, cached_input_cost_pico_usd,"
        " output_cost_pico_usd, cost_pico_usd) VALUES (%s, %s, %s, 'interactive', 1, 100, 0, 5, 300, 0,"
        " 75, 375)",
        (tenant_id, hour, model),
    )


def test_0006_gives_existing_rows_and_ledger_partitions_no_cache_products(new_database):
    schema.downgrade(new_database, "0005")
    now = datetime.now(UTC)
    with psycopg.connect(new_database, autocommit=True) as conn:
        tenant_id = conn.execute("INSERT INTO tenants (name) VALUES ('m6') RETURNING id").fetchone()[0]
        conn.execute(
            "INSERT INTO prices (model, effective_from, input, cached_input, output, batch_input,"
            " batch_cached_input, batch_output, embedding_input, batch_embedding_input)"
            " VALUES ('m6', %s, 3, 0, 15, 1, 0, 7, 3, 1)",
            (now,),
        )
        _attach_march_partition(conn, 2031)  # before the migration
        for request_id, at in (("now", now), ("march", datetime(2031, 3, 2, tzinfo=UTC)),
                               ("may", datetime(2031, 5, 2, tzinfo=UTC))):  # fmt: skip
            _insert_ledger_row(conn, request_id, tenant_id, "m6", at)
        _insert_hourly_rollup(conn, tenant_id, "m6", now.replace(minute=0, second=0, microsecond=0))

    schema.upgrade(new_database)
    with psycopg.connect(new_database, autocommit=True) as conn:
        price = conn.execute(
            "SELECT cache_write, cache_pin, cache_retention, batch_cache_write, batch_cache_pin,"
            " batch_cache_retention FROM prices WHERE model = 'm6'"
        ).fetchone()
        assert price == (0, 0, 0, 0, 0, 0)
        rows = conn.execute(
            "SELECT request_id, tableoid::regclass::text, cache_write_tokens, cache_pinned_tokens,"
            " cache_retained_tokens FROM usage_events WHERE model = 'm6' ORDER BY created_at"
        ).fetchall()
        assert [(r[0], r[2:]) for r in rows] == [("now", (0, 0, 0)), ("march", (0, 0, 0)), ("may", (0, 0, 0))]
        assert rows[1][1] == "usage_partitions.usage_events_2031_03"
        assert rows[2][1] == "usage_partitions.usage_events_default"
        for partition in ("usage_events_2031_03", "usage_events_default"):
            assert set(CACHE_TOKENS) <= _columns(conn, partition, "usage_partitions")
        hourly = conn.execute(
            "SELECT cache_write_tokens, cache_write_cost_pico_usd, cache_retained_cost_pico_usd"
            " FROM usage_hourly WHERE model = 'm6'"
        ).fetchone()
        assert hourly == (0, 0, 0)
        # The check reaches every partition: a count beyond the prompt is refused in March too.
        with pytest.raises(psycopg.errors.CheckViolation, match="ck_usage_events_cache_token_counts"):
            conn.execute(
                "INSERT INTO usage_events (request_id, tenant_id, model, request_class, tier, prompt_tokens,"
                " cached_tokens, completion_tokens, cost_pico_usd, status, created_at, cache_pinned_tokens)"
                " VALUES ('too-many', %s, 'm6', 'interactive', 'default', 10, 0, 0, 0, 'completed',"
                " '2031-03-03T00:00:00+00:00', 11)",
                (tenant_id,),
            )
        with pytest.raises(psycopg.errors.CheckViolation, match="ck_prices_non_negative"):
            conn.execute("UPDATE prices SET batch_cache_pin = -1 WHERE model = 'm6'")

    async def partition_may() -> list[str]:
        db = Database(new_database, pool_size=1)
        try:
            async with db.session() as session:
                return await ensure_usage_partitions(
                    session, at=datetime(2031, 5, 1, tzinfo=UTC), months_ahead=0
                )
        finally:
            await db.dispose()

    # A partition made after the migration takes the default partition's row, new columns and all.
    assert asyncio.run(partition_may()) == ["usage_events_2031_05"]
    with psycopg.connect(new_database) as conn:
        where = conn.execute("SELECT tableoid::regclass::text FROM usage_events WHERE request_id = 'may'")
        assert where.fetchone() == ("usage_partitions.usage_events_2031_05",)

    schema.downgrade(new_database, "0005")
    with psycopg.connect(new_database) as conn:
        assert not set(CACHE_PRICES) & _columns(conn, "prices")
        assert not set(CACHE_TOKENS) & (_columns(conn, "usage_events") | _columns(conn, "usage_hourly"))
        assert not set(CACHE_TOKENS) & _columns(conn, "usage_events_2031_05", "usage_partitions")
        assert conn.execute("SELECT count(*) FROM usage_events WHERE model = 'm6'").fetchone() == (3,)
    schema.upgrade(new_database)


PREDICTION_TOKENS = ("accepted_prediction_tokens", "rejected_prediction_tokens")


def test_0008_gives_existing_ledger_rows_and_rollups_no_prediction_tokens(new_database):
    schema.downgrade(new_database, "0007")
    now = datetime.now(UTC)
    with psycopg.connect(new_database, autocommit=True) as conn:
        tenant_id = conn.execute("INSERT INTO tenants (name) VALUES ('m8') RETURNING id").fetchone()[0]
        _attach_march_partition(conn, 2032)
        for request_id, at in (("m8-now", now), ("m8-march", datetime(2032, 3, 2, tzinfo=UTC))):
            _insert_ledger_row(conn, request_id, tenant_id, "m8", at)
        _insert_hourly_rollup(conn, tenant_id, "m8", now.replace(minute=0, second=0, microsecond=0))

    schema.upgrade(new_database)
    with psycopg.connect(new_database, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT request_id, accepted_prediction_tokens, rejected_prediction_tokens FROM usage_events"
            " WHERE model = 'm8' ORDER BY created_at"
        ).fetchall()
        assert rows == [("m8-now", 0, 0), ("m8-march", 0, 0)]  # rows written before it had no prediction
        hourly = conn.execute(
            "SELECT accepted_prediction_tokens, rejected_prediction_tokens FROM usage_hourly"
            " WHERE model = 'm8'"
        ).fetchone()
        assert hourly == (0, 0)
        assert set(PREDICTION_TOKENS) <= _columns(conn, "usage_events_2032_03", "usage_partitions")
        # The check reaches every partition: prediction tokens beyond the completion are refused in March.
        with pytest.raises(psycopg.errors.CheckViolation, match="ck_usage_events_prediction_token_counts"):
            conn.execute(
                "INSERT INTO usage_events (request_id, tenant_id, model, request_class, tier, prompt_tokens,"
                " cached_tokens, completion_tokens, cost_pico_usd, status, created_at,"
                " accepted_prediction_tokens, rejected_prediction_tokens) VALUES ('m8-too-many', %s, 'm8',"
                " 'interactive', 'default', 10, 0, 5, 0, 'completed', '2032-03-03T00:00:00+00:00', 3, 3)",
                (tenant_id,),
            )

    schema.downgrade(new_database, "0007")
    with psycopg.connect(new_database) as conn:
        assert not set(PREDICTION_TOKENS) & (_columns(conn, "usage_events") | _columns(conn, "usage_hourly"))
        assert not set(PREDICTION_TOKENS) & _columns(conn, "usage_events_2032_03", "usage_partitions")
        assert conn.execute("SELECT count(*) FROM usage_events WHERE model = 'm8'").fetchone() == (2,)
    schema.upgrade(new_database)
