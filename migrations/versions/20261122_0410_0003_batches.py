"""Files and the batch tier: files, batches, batch_items.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 04:10:00+00:00

Table and column names are the contract of docs/architecture.md "Data" (``files``, ``batches``,
``batch_items``). ``batch_items`` holds one row per input line: its lease (``lease_owner``,
``lease_expires_at``; a line is ``running`` exactly when it has an owner), attempts, the derived
``request_id`` (unique: the ledger's idempotency key) and the result.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _created_at() -> sa.Column:
    return sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"),
                     nullable=False)


def _ts(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _zero(name: str, kind: type[sa.types.TypeEngine]) -> sa.Column:
    return sa.Column(name, kind(), server_default=sa.text("0"), nullable=False)


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("filename", sa.String(length=512), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("storage_key", sa.String(length=512), nullable=False),
        _created_at(),
        _ts("expires_at"),
        sa.CheckConstraint("purpose IN ('batch', 'batch_output')", name=op.f("ck_files_purpose")),
        sa.CheckConstraint("bytes >= 0", name=op.f("ck_files_bytes_non_negative")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_files_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_files")),
    )
    op.create_index("ix_files_tenant_id_created_at", "files", ["tenant_id", "created_at"])
    op.create_index("ix_files_expires_at", "files", ["expires_at"])

    op.create_table(
        "batches",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("api_key_id", sa.BigInteger(), nullable=True),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=True),
        sa.Column("input_file_id", sa.String(length=64), nullable=False),
        sa.Column("completion_window", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), server_default="validating", nullable=False),
        sa.Column("errors", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("output_file_id", sa.String(length=64), nullable=True),
        sa.Column("error_file_id", sa.String(length=64), nullable=True),
        sa.Column("metadata", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("output_expires_after_s", sa.Integer(), nullable=True),
        _zero("request_total", sa.Integer),
        _zero("request_completed", sa.Integer),
        _zero("request_failed", sa.Integer),
        _zero("prompt_tokens", sa.BigInteger),
        _zero("cached_tokens", sa.BigInteger),
        _zero("completion_tokens", sa.BigInteger),
        _zero("cost_pico_usd", sa.BigInteger),
        _created_at(),
        _ts("expires_at", nullable=False),
        _ts("in_progress_at"),
        _ts("finalizing_at"),
        _ts("completed_at"),
        _ts("failed_at"),
        _ts("expired_at"),
        _ts("cancelling_at"),
        _ts("cancelled_at"),
        sa.CheckConstraint(
            "status IN ('validating', 'failed', 'in_progress', 'finalizing', 'completed', 'expired',"
            " 'cancelling', 'cancelled')",
            name=op.f("ck_batches_status"),
        ),
        sa.CheckConstraint(
            "request_total >= 0 AND request_completed >= 0 AND request_failed >= 0"
            " AND request_completed + request_failed <= request_total",
            name=op.f("ck_batches_request_counts"),
        ),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_batches_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_keys.id"], name=op.f("fk_batches_api_key_id_api_keys"),
                                ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
    )
    op.create_index("ix_batches_tenant_id_created_at", "batches", ["tenant_id", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])

    op.create_table(
        "batch_items",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.Text(), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("request_body", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("status", sa.String(length=16), server_default="pending", nullable=False),
        sa.Column("lease_owner", sa.String(length=128), nullable=True),
        _ts("lease_expires_at"),
        _zero("attempts", sa.Integer),
        sa.Column("response_status", sa.Integer(), nullable=True),
        sa.Column("response", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("error", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("served_pool", sa.String(length=32), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("cached_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("cost_pico_usd", sa.BigInteger(), nullable=True),
        _ts("finished_at"),
        _created_at(),
        sa.CheckConstraint(
            "status IN ('pending', 'running', 'completed', 'failed', 'cancelled', 'expired')",
            name=op.f("ck_batch_items_status"),
        ),
        sa.CheckConstraint("(status = 'running') = (lease_owner IS NOT NULL)",
                           name=op.f("ck_batch_items_lease")),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], name=op.f("fk_batch_items_batch_id_batches"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batch_items")),
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_batch_items_batch_id_custom_id"),
        sa.UniqueConstraint("batch_id", "line", name="uq_batch_items_batch_id_line"),
        sa.UniqueConstraint("request_id", name=op.f("uq_batch_items_request_id")),
    )
    op.create_index("ix_batch_items_batch_id_status", "batch_items", ["batch_id", "status"])
    op.create_index("ix_batch_items_status_lease_expires_at", "batch_items", ["status", "lease_expires_at"])


def downgrade() -> None:
    op.drop_table("batch_items")
    op.drop_table("batches")
    op.drop_table("files")
