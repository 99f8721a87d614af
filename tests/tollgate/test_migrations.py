"""Alembic on real Postgres: the history goes up, down and up again, and matches the ORM models."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, pool

from billing.partitions import ensure_usage_partitions
from billing.statements import build_statement, carry_rounding
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


# Ledger rows as the schema before 0011 held them: (request id, model, class, prompt, cached, completion,
# cache write, pinned, retained, cost, created_at), and the per-kind costs 0011 must give each one (input,
# cached_input, output, cache_write, cache_pinned, cache_retained), worked out by hand from the price rows.
_M11_CHANGE = datetime(2032, 3, 10, 12, tzinfo=UTC)
_M11_ROWS = [
    # Interactive at the first price: 60 x 3 + 40 x 0.3 + 7 x 15 (pico-USD per token, millions).
    ("m11-old", "m11", "interactive", 100, 40, 7, 0, 0, 0, 297_000_000, datetime(2032, 3, 2, tzinfo=UTC),
     (180_000_000, 12_000_000, 105_000_000, 0, 0, 0)),
    # Admitted before the price change, recorded after it: still the first price.
    ("m11-straddle", "m11", "interactive", 100, 40, 7, 0, 0, 0, 297_000_000,
     _M11_CHANGE + timedelta(seconds=30), (180_000_000, 12_000_000, 105_000_000, 0, 0, 0)),
    # Batch at the second price, with the cache products: 60 x 1 + 40 x 0.1 + 48 x 0.5 + 96 x 0.25.
    ("m11-batch", "m11", "batch", 100, 40, 0, 48, 96, 0, 112_000_000, _M11_CHANGE + timedelta(hours=2),
     (60_000_000, 4_000_000, 0, 24_000_000, 24_000_000, 0)),
    # An embeddings request at the second price: all 100 prompt tokens at 0.05, cached ones included.
    ("m11-embed", "m11", "interactive", 100, 40, 0, 0, 0, 0, 5_000_000, _M11_CHANGE + timedelta(hours=3),
     (5_000_000, 0, 0, 0, 0, 0)),
    # Written by hand (matches no price): apportioned by the second price's weights (60 x 2, 40 x 0.2,
    # 10 x 8 = 120 : 8 : 80 of 1000), largest remainder first.
    ("m11-hand", "m11", "interactive", 100, 40, 10, 0, 0, 0, 1_000, _M11_CHANGE + timedelta(hours=4),
     (577, 38, 385, 0, 0, 0)),
]


def test_0011_prices_each_ledger_row_once_and_keeps_every_amount(new_database):
    """A ledger written by the schema before 0011 (two price rows, batch, cache products, an embeddings row,
    a hand-made row): each row gets the per-kind costs the rollups used to search for; the rollups and the
    statements read the same tokens and amounts, to the pico-dollar, before and after."""
    schema.downgrade(new_database, "0010")
    with psycopg.connect(new_database, autocommit=True) as conn:
        tenant_id = conn.execute("INSERT INTO tenants (name) VALUES ('m11') RETURNING id").fetchone()[0]
        _attach_march_partition(conn, 2032)
        for start, (inp, out, write, pin, embed) in (
                (datetime(2020, 1, 1, tzinfo=UTC), (3_000_000, 15_000_000, 0, 0, 50_000)),
                (_M11_CHANGE, (2_000_000, 8_000_000, 1_000_000, 500_000, 50_000))):
            conn.execute(
                "INSERT INTO prices (model, effective_from, input, cached_input, output, batch_input,"
                " batch_cached_input, batch_output, embedding_input, batch_embedding_input, cache_write,"
                " cache_pin, cache_retention, batch_cache_write, batch_cache_pin, batch_cache_retention)"
                " VALUES ('m11', %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, 0, %s, %s, 0)",
                (start, inp, inp // 10, out, inp // 2, inp // 20, out // 2, embed, embed // 2, write, pin,
                 write // 2, pin // 2))
        for rid, model, klass, prompt, cached, completion, write, pin, kept, cost, at, _ in _M11_ROWS:
            conn.execute(
                "INSERT INTO usage_events (request_id, tenant_id, model, request_class, tier, prompt_tokens,"
                " cached_tokens, completion_tokens, cache_write_tokens, cache_pinned_tokens,"
                " cache_retained_tokens, cost_pico_usd, status, created_at)"
                " VALUES (%s, %s, %s, %s, 'default', %s, %s, %s, %s, %s, %s, %s, 'completed', %s)",
                (rid, tenant_id, model, klass, prompt, cached, completion, write, pin, kept, cost, at))
    _old_rollups(new_database)  # the rollups as the code before 0011 kept them
    with psycopg.connect(new_database) as conn:
        kinds = ("input", "cached_input", "output", "cache_write", "cache_pinned", "cache_retained")
        before = conn.execute(
            "SELECT request_class, sum(input_tokens), sum(cached_input_tokens), sum(output_tokens),"
            " sum(cache_write_tokens), sum(cache_pinned_tokens), sum(cache_retained_tokens),"
            f" {', '.join(f'sum({k}_cost_pico_usd)' for k in kinds)}, sum(cost_pico_usd), sum(requests)"
            " FROM usage_hourly WHERE model = 'm11' GROUP BY request_class ORDER BY request_class").fetchall()
    old_lines = _statement_lines(new_database, tenant_id)
    old_costs = _daily_costs_before(new_database, tenant_id)
    old_export = _stripe_hours(new_database, tenant_id)

    schema.upgrade(new_database)
    with psycopg.connect(new_database) as conn:
        costs = conn.execute(
            f"SELECT request_id, {', '.join(f'{k}_cost_pico_usd' for k in kinds)} FROM usage_events"
            " WHERE model = 'm11'").fetchall()
        assert {r[0]: tuple(r[1:]) for r in costs} == {r[0]: r[-1] for r in _M11_ROWS}
        after = conn.execute(
            "SELECT request_class, sum(prompt_tokens - cached_tokens), sum(cached_tokens),"
            " sum(completion_tokens), sum(cache_write_tokens), sum(cache_pinned_tokens),"
            " sum(cache_retained_tokens),"
            f" {', '.join(f'sum({k}_cost_pico_usd)' for k in kinds)}, sum(cost_pico_usd), sum(requests)"
            " FROM usage_hourly WHERE model = 'm11' GROUP BY request_class ORDER BY request_class").fetchall()
        assert after == before
        # The sum check reaches the partitions: a row whose kinds do not add up to its cost is refused.
        with pytest.raises(psycopg.errors.CheckViolation, match="ck_usage_events_kind_costs"):
            conn.execute(
                "INSERT INTO usage_events (request_id, tenant_id, model, request_class, tier, prompt_tokens,"
                " completion_tokens, cost_pico_usd, input_cost_pico_usd, status, created_at) VALUES"
                " ('m11-bad', %s, 'm11', 'interactive', 'default', 10, 0, 5, 4, 'completed',"
                " '2032-03-03T00:00:00+00:00')", (tenant_id,))
    assert _statement_lines(new_database, tenant_id) == old_lines
    assert _daily_costs_after(new_database, tenant_id) == old_costs  # the Costs API's line items
    assert _stripe_hours(new_database, tenant_id) == old_export  # what the Stripe export sends per hour
    assert [line[1:3] for line in old_lines] == [
        ("interactive", "input"), ("interactive", "cached_input"), ("interactive", "output"),
        ("batch", "input"), ("batch", "cached_input"), ("batch", "cache_write"), ("batch", "cache_pinned")]

    schema.downgrade(new_database, "0010")  # and back: the old rollup columns, rebuilt from the ledger
    with psycopg.connect(new_database) as conn:
        again = conn.execute(
            "SELECT request_class, sum(input_tokens), sum(cached_input_tokens), sum(output_tokens),"
            " sum(cache_write_tokens), sum(cache_pinned_tokens), sum(cache_retained_tokens),"
            f" {', '.join(f'sum({k}_cost_pico_usd)' for k in kinds)}, sum(cost_pico_usd), sum(requests)"
            " FROM usage_hourly WHERE model = 'm11' GROUP BY request_class ORDER BY request_class").fetchall()
        assert again == before
    schema.upgrade(new_database)


def _old_rollups(url: str) -> None:
    """The old rollups of March 2032: the per-kind split the code before 0011 found (its frozen copy in the
    migration), summed per bucket as ``billing.rollups`` did."""
    from importlib import import_module

    migration = import_module("migrations.versions.20261128_1700_0011_kind_costs")
    with psycopg.connect(url, autocommit=True) as conn:
        prices = migration._Prices(_as_rows(conn, "SELECT * FROM prices ORDER BY model, effective_from"))
        rows = _as_rows(conn, "SELECT * FROM usage_events WHERE model = 'm11'")
        buckets: dict[tuple, list[int]] = {}
        for r in rows:
            key = (r.tenant_id, r.created_at.replace(minute=0, second=0, microsecond=0), r.model,
                   r.request_class)
            sums = buckets.setdefault(key, [0] * 11)
            split = prices.split(r)
            kinds = (r.prompt_tokens - r.cached_tokens, r.cached_tokens, r.completion_tokens,
                     r.cache_write_tokens, r.cache_pinned_tokens, r.cache_retained_tokens)
            for i, value in enumerate((*kinds, *split[:3], r.cost_pico_usd, 1)):
                sums[i] += value
            for i, value in enumerate(split[3:]):
                key_costs = buckets.setdefault((*key, "cache"), [0, 0, 0])
                key_costs[i] += value
        for key, sums in buckets.items():
            if key[-1] == "cache":
                continue
            cache = buckets.get((*key, "cache"), [0, 0, 0])
            conn.execute(
                "INSERT INTO usage_hourly (tenant_id, hour, model, request_class, input_tokens,"
                " cached_input_tokens, output_tokens, cache_write_tokens, cache_pinned_tokens,"
                " cache_retained_tokens, input_cost_pico_usd, cached_input_cost_pico_usd,"
                " output_cost_pico_usd, cost_pico_usd, requests, cache_write_cost_pico_usd,"
                " cache_pinned_cost_pico_usd, cache_retained_cost_pico_usd) VALUES (%s, %s, %s, %s, %s, %s,"
                " %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)", (*key, *sums, *cache))


def _as_rows(conn: psycopg.Connection, sql: str) -> list:
    from types import SimpleNamespace

    cur = conn.execute(sql)
    names = [c.name for c in cur.description]
    return [SimpleNamespace(_mapping=dict(zip(names, row, strict=True)), **dict(zip(names, row, strict=True)))
            for row in cur.fetchall()]


def _statement_lines(url: str, tenant_id: int) -> list[tuple]:
    """The March 2032 statement's lines (model, class, kind, tokens, pico-USD, cents), from the old
    rollup columns before 0011 and by ``billing.statements`` after it."""
    with psycopg.connect(url) as conn:
        columns = _columns(conn, "usage_hourly")
    if "input_tokens" in columns:  # the schema before 0011: the old statement's query, by hand
        kinds = ("input", "cached_input", "output", "cache_write", "cache_pinned", "cache_retained")
        tokens = ("input_tokens", "cached_input_tokens", "output_tokens", "cache_write_tokens",
                  "cache_pinned_tokens", "cache_retained_tokens")
        with psycopg.connect(url) as conn:
            rows = conn.execute(
                f"SELECT model, request_class, {', '.join(f'sum({t})' for t in tokens)},"
                f" {', '.join(f'sum({k}_cost_pico_usd)' for k in kinds)} FROM usage_hourly"
                " WHERE tenant_id = %s GROUP BY model, request_class", (tenant_id,)).fetchall()
        order = {"interactive": 0, "batch": 1}
        raw = []
        for model, klass, *sums in sorted(rows, key=lambda r: (r[0], order[r[1]])):
            for kind, count, amount in zip(kinds, sums[:6], sums[6:], strict=True):
                if count or amount:
                    raw.append((model, klass, kind, int(count), int(amount)))
        cents = carry_rounding([r[4] for r in raw])
        return [(*r, c) for r, c in zip(raw, cents, strict=True)]

    async def build() -> list[tuple]:
        db = Database(url, pool_size=1)
        try:
            async with db.session() as session:
                statement = await build_statement(session, tenant_id, "2032-03")
        finally:
            await db.dispose()
        return [(line.model, line.request_class, line.token_kind, line.tokens, line.amount_pico_usd,
                 line.amount_cents) for line in statement.lines]

    return asyncio.run(build())


def _daily_costs_before(url: str, tenant_id: int) -> dict[tuple[int, str], tuple[float, int]]:
    """The Costs API's answer for March 2032 before 0011, from the old rollup columns: per (day, line item)
    the USD amount and the tokens, as ``gateway.usage.service.costs`` computed them."""
    names = {"input": "input", "cached_input": "cached input", "output": "output",
             "cache_write": "cache write", "cache_pinned": "cache pin", "cache_retained": "cache retention"}
    tokens = {"input": "input_tokens", "cached_input": "cached_input_tokens", "output": "output_tokens",
              "cache_write": "cache_write_tokens", "cache_pinned": "cache_pinned_tokens",
              "cache_retained": "cache_retained_tokens"}
    out: dict[tuple[int, str], list[int]] = {}
    with psycopg.connect(url) as conn:
        for kind, column in tokens.items():
            rows = conn.execute(
                f"SELECT hour, model, request_class, {column}, {kind}_cost_pico_usd FROM usage_hourly"
                " WHERE tenant_id = %s", (tenant_id,)).fetchall()
            for hour, model, klass, count, amount in rows:
                if kind.startswith("cache_") and not (count or amount):
                    continue
                day = int(hour.replace(hour=0).timestamp())
                name = f"{model}, {'batch ' if klass == 'batch' else ''}{names[kind]}"
                acc = out.setdefault((day, name), [0, 0])
                acc[0] += amount
                acc[1] += count
    return {key: (float(Decimal(amount) / Decimal(10**12)), count) for key, (amount, count) in out.items()}


def _daily_costs_after(url: str, tenant_id: int) -> dict[tuple[int, str], tuple[float, int]]:
    from gateway.usage.repository import UsageRepository
    from gateway.usage.service import costs

    async def ask() -> dict[str, Any]:
        db = Database(url, pool_size=1)
        try:
            async with db.session() as session:
                return await costs(UsageRepository(session, tenant_id),
                                   start_time=int(datetime(2032, 3, 1, tzinfo=UTC).timestamp()),
                                   end_time=int(datetime(2032, 4, 1, tzinfo=UTC).timestamp()),
                                   bucket_width="1d", group_by=["line_item"], limit=31, page=None,
                                   now=int(datetime(2032, 5, 1, tzinfo=UTC).timestamp()))
        finally:
            await db.dispose()

    page = asyncio.run(ask())
    return {(bucket["start_time"], r["line_item"]): (r["amount"]["value"], r["quantity"])
            for bucket in page["data"] for r in bucket["results"]}


def _stripe_hours(url: str, tenant_id: int) -> dict[datetime, int]:
    from billing.stripe_export import _hourly_ledger

    async def hours() -> dict[datetime, int]:
        db = Database(url, pool_size=1)
        try:
            async with db.session() as session:
                return await _hourly_ledger(session, tenant_id, datetime(2032, 3, 1, tzinfo=UTC),
                                            datetime(2032, 4, 1, tzinfo=UTC))
        finally:
            await db.dispose()

    return asyncio.run(hours())
