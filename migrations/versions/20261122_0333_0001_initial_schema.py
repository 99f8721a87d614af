"""Initial schema: tenants, api_keys, prices, usage_events, admins, audit_log.

Revision ID: 0001
Revises:
Create Date: 2026-11-22 03:33:29+00:00

Column names are the contract of docs/architecture.md "Data". Money columns are BigInteger pico-USD.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _id() -> sa.Column:
    return sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False)


def _created_at() -> sa.Column:
    return sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"),
                     nullable=False)


def upgrade() -> None:
    op.create_table(
        "tenants",
        _id(),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("tier", sa.String(length=32), server_default="default", nullable=False),
        sa.Column("status", sa.String(length=16), server_default="active", nullable=False),
        sa.Column("suspended_reason", sa.String(length=16), nullable=True),
        sa.Column("tpm_limit", sa.BigInteger(), nullable=True),
        sa.Column("rpm_limit", sa.BigInteger(), nullable=True),
        sa.Column("max_concurrency", sa.Integer(), nullable=True),
        sa.Column("batch_tpd_limit", sa.BigInteger(), nullable=True),
        sa.Column("monthly_budget_pico_usd", sa.BigInteger(), nullable=True),
        sa.Column("stripe_customer_id", sa.String(length=255), nullable=True),
        _created_at(),
        sa.CheckConstraint("(status = 'suspended') = (suspended_reason IS NOT NULL)",
                           name=op.f("ck_tenants_suspension")),
        sa.CheckConstraint("status IN ('active', 'suspended')", name=op.f("ck_tenants_status")),
        sa.CheckConstraint("suspended_reason IS NULL OR suspended_reason IN ('admin', 'billing')",
                           name=op.f("ck_tenants_suspended_reason")),
        sa.CheckConstraint(
            "(tpm_limit IS NULL OR tpm_limit >= 0) AND (rpm_limit IS NULL OR rpm_limit >= 0)"
            " AND (max_concurrency IS NULL OR max_concurrency >= 0)"
            " AND (batch_tpd_limit IS NULL OR batch_tpd_limit >= 0)"
            " AND (monthly_budget_pico_usd IS NULL OR monthly_budget_pico_usd >= 0)",
            name=op.f("ck_tenants_limits_non_negative"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
        sa.UniqueConstraint("stripe_customer_id", name=op.f("uq_tenants_stripe_customer_id")),
    )
    op.create_table(
        "api_keys",
        _id(),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(length=128), server_default="", nullable=False),
        sa.Column("prefix", sa.String(length=32), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("scopes", postgresql.ARRAY(sa.Text()), nullable=True),
        sa.Column("allowed_models", postgresql.ARRAY(sa.Text()), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        _created_at(),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_api_keys_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("prefix", name=op.f("uq_api_keys_prefix")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])
    op.create_table(
        "prices",
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("effective_from", sa.DateTime(timezone=True), nullable=False),
        sa.Column("input", sa.BigInteger(), nullable=False),
        sa.Column("cached_input", sa.BigInteger(), nullable=False),
        sa.Column("output", sa.BigInteger(), nullable=False),
        sa.Column("batch_input", sa.BigInteger(), nullable=False),
        sa.Column("batch_cached_input", sa.BigInteger(), nullable=False),
        sa.Column("batch_output", sa.BigInteger(), nullable=False),
        _created_at(),
        sa.CheckConstraint(
            "input >= 0 AND cached_input >= 0 AND output >= 0 AND batch_input >= 0"
            " AND batch_cached_input >= 0 AND batch_output >= 0",
            name=op.f("ck_prices_non_negative"),
        ),
        sa.PrimaryKeyConstraint("model", "effective_from", name=op.f("pk_prices")),
    )
    op.create_table(
        "usage_events",
        _id(),
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
    op.create_table(
        "admins",
        _id(),
        sa.Column("email", sa.String(length=320), nullable=False),
        sa.Column("password_hash", sa.String(length=255), nullable=True),
        sa.Column("api_token_hash", sa.String(length=64), nullable=True),
        _created_at(),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_admins")),
        sa.UniqueConstraint("api_token_hash", name=op.f("uq_admins_api_token_hash")),
        sa.UniqueConstraint("email", name=op.f("uq_admins_email")),
    )
    op.create_table(
        "audit_log",
        _id(),
        sa.Column("actor", sa.String(length=320), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=True),
        sa.Column("details", postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"),
                  nullable=False),
        _created_at(),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_audit_log_tenant_id_tenants"),
                                ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    op.create_index("ix_audit_log_created_at", "audit_log", ["created_at"])
    op.create_index(op.f("ix_audit_log_tenant_id"), "audit_log", ["tenant_id"])


def downgrade() -> None:
    op.drop_table("audit_log")
    op.drop_table("admins")
    op.drop_table("usage_events")
    op.drop_table("prices")
    op.drop_table("api_keys")
    op.drop_table("tenants")
