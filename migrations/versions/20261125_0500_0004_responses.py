"""Stored responses of the Responses API: ``responses``.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25 05:00:00+00:00

One row per stored ``/v1/responses`` result (``tollgate.models.StoredResponse``): the ``Response`` object
(``body``), the request's input items (``input_items``), the link to the previous response of its
conversation, when it expires (``responses_retention_s``), and for a ``background`` response the request a
worker runs and the key it runs as.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("api_key_id", sa.BigInteger(), nullable=True),
        sa.Column("previous_response_id", sa.String(length=64), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("request", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("input_items", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("body", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "status IN ('completed', 'incomplete', 'failed', 'cancelled', 'in_progress', 'queued')",
            name=op.f("ck_responses_status"),
        ),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_responses_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_keys.id"],
                                name=op.f("fk_responses_api_key_id_api_keys"), ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_responses")),
    )
    op.create_index("ix_responses_tenant_id_created_at", "responses", ["tenant_id", "created_at"])
    op.create_index("ix_responses_expires_at", "responses", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_responses_expires_at", table_name="responses")
    op.drop_index("ix_responses_tenant_id_created_at", table_name="responses")
    op.drop_table("responses")
