"""Billing: the ledger partitioned by month, hourly rollups, Stripe export outbox, webhooks, budget alerts.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 04:00:00+00:00

- ``usage_events`` becomes a table partitioned by ``RANGE (created_at)``, one partition per UTC month in
  the schema ``usage_partitions`` (plus a default partition, so an insert never fails for want of a
  partition; ``billing.partitions`` creates months ahead and moves stray rows out of the default).
  A partitioned table's unique constraints must contain the partition key, so request-id idempotency
  moves to the unpartitioned ``usage_request_ids`` (``request_id`` primary key), inserted in the same
  transaction as the ledger row (``billing.repository.insert_usage_events``). Existing rows are copied,
  ids kept.
- ``usage_hourly``: per tenant × hour × model × class, the token kinds as columns (tokens and exact
  pico-USD cost of input, cached input and output) plus the request count and the ledger cost.
- ``stripe_exports`` (outbox of meter events and balance credits), ``stripe_export_state`` (per tenant
  running totals), ``stripe_provisioning`` (the meter, product and price), ``stripe_events`` (webhook
  deduplication), ``budget_alerts`` (80 % / 100 % of the monthly budget; dashboard flag + webhook outbox).
- ``tenants``: ``alert_webhook_url``, ``alert_webhook_secret``, ``stripe_subscription_id``,
  ``payment_failed_at``.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PARTITION_SCHEMA = "usage_partitions"
MONTHS_AHEAD = 3

_USAGE_COLUMNS = ("id, request_id, tenant_id, api_key_id, model, request_class, tier, prompt_tokens, "
                  "cached_tokens, completion_tokens, cost_pico_usd, status, ttft_ms, tpot_ms, created_at")


def _created_at() -> sa.Column:
    return sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"),
                     nullable=False)


def _create_partitioned_usage_events() -> None:
    op.create_table(
        "usage_events",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("api_key_id", sa.BigInteger(), nullable=True),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("request_class", sa.String(length=16), nullable=False),
        sa.Column("tier", sa.String(length=32), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("cost_pico_usd", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("tpot_ms", sa.Float(), nullable=True),
        _created_at(),
        sa.CheckConstraint("request_class IN ('interactive', 'batch')",
                           name=op.f("ck_usage_events_request_class")),
        sa.CheckConstraint("cost_pico_usd >= 0", name=op.f("ck_usage_events_cost_non_negative")),
        sa.CheckConstraint(
            "prompt_tokens >= 0 AND completion_tokens >= 0 AND cached_tokens >= 0"
            " AND cached_tokens <= prompt_tokens",
            name=op.f("ck_usage_events_token_counts"),
        ),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_keys.id"],
                                name=op.f("fk_usage_events_api_key_id_api_keys")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name=op.f("fk_usage_events_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("id", "created_at", name=op.f("pk_usage_events")),
        postgresql_partition_by="RANGE (created_at)",
    )
    op.create_index("ix_usage_events_created_at", "usage_events", ["created_at"])
    op.create_index("ix_usage_events_tenant_id_created_at", "usage_events", ["tenant_id", "created_at"])
    op.create_index("ix_usage_events_request_id", "usage_events", ["request_id"])
    op.execute(f"CREATE SCHEMA IF NOT EXISTS {PARTITION_SCHEMA}")
    op.execute(f"CREATE TABLE {PARTITION_SCHEMA}.usage_events_default PARTITION OF usage_events DEFAULT")
    # One partition per month from the oldest row's month (or this month) to MONTHS_AHEAD ahead.
    op.execute(f"""
        DO $$
        DECLARE
          first_month date := date_trunc('month', LEAST(
            COALESCE((SELECT min(created_at) FROM usage_events_legacy), now()), now()) AT TIME ZONE 'UTC');
          last_month date := date_trunc('month', now() AT TIME ZONE 'UTC')
                             + interval '{MONTHS_AHEAD} months';
          m date;
        BEGIN
          m := first_month;
          WHILE m <= last_month LOOP
            EXECUTE format(
              'CREATE TABLE {PARTITION_SCHEMA}.%I PARTITION OF usage_events FOR VALUES FROM (%L) TO (%L)',
              'usage_events_' || to_char(m, 'YYYY_MM'),
              (m::timestamp AT TIME ZONE 'UTC'), ((m + interval '1 month')::timestamp AT TIME ZONE 'UTC'));
            m := m + interval '1 month';
          END LOOP;
        END $$;
    """)


def upgrade() -> None:
    op.add_column("tenants", sa.Column("alert_webhook_url", sa.String(length=2048), nullable=True))
    op.add_column("tenants", sa.Column("alert_webhook_secret", sa.String(length=128), nullable=True))
    op.add_column("tenants", sa.Column("stripe_subscription_id", sa.String(length=255), nullable=True))
    op.add_column("tenants", sa.Column("payment_failed_at", sa.DateTime(timezone=True), nullable=True))

    # The ledger: keep the rows, change the table.
    op.execute("CREATE TABLE usage_events_legacy AS TABLE usage_events")
    op.drop_table("usage_events")
    _create_partitioned_usage_events()
    op.execute(f"INSERT INTO usage_events ({_USAGE_COLUMNS}) OVERRIDING SYSTEM VALUE "
               f"SELECT {_USAGE_COLUMNS} FROM usage_events_legacy")
    op.execute("SELECT setval(pg_get_serial_sequence('usage_events', 'id'), "
               "COALESCE((SELECT max(id) FROM usage_events), 0) + 1, false)")
    op.create_table(
        "usage_request_ids",
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_usage_request_ids")),
    )
    op.execute("INSERT INTO usage_request_ids (request_id, created_at) "
               "SELECT request_id, created_at FROM usage_events_legacy")
    op.drop_table("usage_events_legacy")

    op.create_table(
        "usage_hourly",
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("request_class", sa.String(length=16), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("input_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_input_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("input_cost_pico_usd", sa.BigInteger(), nullable=False),
        sa.Column("cached_input_cost_pico_usd", sa.BigInteger(), nullable=False),
        sa.Column("output_cost_pico_usd", sa.BigInteger(), nullable=False),
        sa.Column("cost_pico_usd", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("request_class IN ('interactive', 'batch')",
                           name=op.f("ck_usage_hourly_request_class")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name=op.f("fk_usage_hourly_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("tenant_id", "hour", "model", "request_class", name=op.f("pk_usage_hourly")),
    )
    op.create_index("ix_usage_hourly_hour", "usage_hourly", ["hour"])

    op.create_table(
        "stripe_provisioning",
        sa.Column("id", sa.SmallInteger(), autoincrement=False, nullable=False),
        sa.Column("meter_event_name", sa.String(length=100), nullable=False),
        sa.Column("meter_id", sa.String(length=255), nullable=False),
        sa.Column("product_id", sa.String(length=255), nullable=False),
        sa.Column("price_id", sa.String(length=255), nullable=False),
        _created_at(),
        sa.CheckConstraint("id = 1", name=op.f("ck_stripe_provisioning_singleton")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_stripe_provisioning")),
    )
    op.create_table(
        "stripe_export_state",
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("since_hour", sa.DateTime(timezone=True), nullable=False),
        sa.Column("covered_pico_usd", sa.Numeric(38, 0), server_default=sa.text("0"), nullable=False),
        sa.Column("sent_micro_usd", sa.Numeric(38, 0), server_default=sa.text("0"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name=op.f("fk_stripe_export_state_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_stripe_export_state")),
    )
    op.create_table(
        "stripe_exports",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("identifier", sa.String(length=128), nullable=False),
        sa.Column("stripe_customer_id", sa.String(length=255), nullable=False),
        sa.Column("amount_pico_usd", sa.BigInteger(), nullable=False),
        sa.Column("covered_pico_usd", sa.BigInteger(), nullable=False),
        sa.Column("value_micro_usd", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), server_default="pending", nullable=False),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("stripe_object_id", sa.String(length=255), nullable=True),
        _created_at(),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("kind IN ('meter_event', 'credit')", name=op.f("ck_stripe_exports_kind")),
        sa.CheckConstraint("status IN ('pending', 'sent')", name=op.f("ck_stripe_exports_status")),
        sa.CheckConstraint("revision >= 1", name=op.f("ck_stripe_exports_revision")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name=op.f("fk_stripe_exports_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_stripe_exports")),
        sa.UniqueConstraint("identifier", name=op.f("uq_stripe_exports_identifier")),
        sa.UniqueConstraint("tenant_id", "hour", "revision", name=op.f("uq_stripe_exports_tenant_id")),
    )
    op.create_index("ix_stripe_exports_status_id", "stripe_exports", ["status", "id"])
    op.create_table(
        "stripe_events",
        sa.Column("id", sa.String(length=255), nullable=False),
        sa.Column("type", sa.String(length=128), nullable=False),
        sa.Column("event_created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_stripe_events")),
    )
    op.create_table(
        "budget_alerts",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("month", sa.String(length=7), nullable=False),
        sa.Column("threshold_percent", sa.SmallInteger(), nullable=False),
        sa.Column("spend_pico_usd", sa.BigInteger(), nullable=False),
        sa.Column("budget_pico_usd", sa.BigInteger(), nullable=False),
        sa.Column("webhook_status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        _created_at(),
        sa.CheckConstraint("webhook_status IN ('none', 'pending', 'delivered', 'failed')",
                           name=op.f("ck_budget_alerts_webhook_status")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name=op.f("fk_budget_alerts_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_budget_alerts")),
        sa.UniqueConstraint("tenant_id", "month", "threshold_percent",
                            name=op.f("uq_budget_alerts_tenant_id")),
    )


def downgrade() -> None:
    op.drop_table("budget_alerts")
    op.drop_table("stripe_events")
    op.drop_index("ix_stripe_exports_status_id", table_name="stripe_exports")
    op.drop_table("stripe_exports")
    op.drop_table("stripe_export_state")
    op.drop_table("stripe_provisioning")
    op.drop_index("ix_usage_hourly_hour", table_name="usage_hourly")
    op.drop_table("usage_hourly")

    op.execute(f"CREATE TABLE usage_events_legacy AS SELECT {_USAGE_COLUMNS} FROM usage_events")
    op.drop_table("usage_events")
    op.drop_table("usage_request_ids")
    op.execute(f"DROP SCHEMA IF EXISTS {PARTITION_SCHEMA} CASCADE")
    op.create_table(
        "usage_events",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("api_key_id", sa.BigInteger(), nullable=True),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("request_class", sa.String(length=16), nullable=False),
        sa.Column("tier", sa.String(length=32), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("cost_pico_usd", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("tpot_ms", sa.Float(), nullable=True),
        _created_at(),
        sa.CheckConstraint("request_class IN ('interactive', 'batch')",
                           name=op.f("ck_usage_events_request_class")),
        sa.CheckConstraint("cost_pico_usd >= 0", name=op.f("ck_usage_events_cost_non_negative")),
        sa.CheckConstraint(
            "prompt_tokens >= 0 AND completion_tokens >= 0 AND cached_tokens >= 0"
            " AND cached_tokens <= prompt_tokens",
            name=op.f("ck_usage_events_token_counts"),
        ),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_keys.id"],
                                name=op.f("fk_usage_events_api_key_id_api_keys")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name=op.f("fk_usage_events_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_events")),
        sa.UniqueConstraint("request_id", name=op.f("uq_usage_events_request_id")),
    )
    op.create_index("ix_usage_events_created_at", "usage_events", ["created_at"])
    op.create_index("ix_usage_events_tenant_id_created_at", "usage_events", ["tenant_id", "created_at"])
    op.execute(f"INSERT INTO usage_events ({_USAGE_COLUMNS}) OVERRIDING SYSTEM VALUE "
               f"SELECT {_USAGE_COLUMNS} FROM usage_events_legacy")
    op.execute("SELECT setval(pg_get_serial_sequence('usage_events', 'id'), "
               "COALESCE((SELECT max(id) FROM usage_events), 0) + 1, false)")
    op.drop_table("usage_events_legacy")

    op.drop_column("tenants", "payment_failed_at")
    op.drop_column("tenants", "stripe_subscription_id")
    op.drop_column("tenants", "alert_webhook_secret")
    op.drop_column("tenants", "alert_webhook_url")
