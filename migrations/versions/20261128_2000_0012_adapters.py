"""Tenants' LoRA adapters: the ``adapters`` table, and adapter bundles among the files.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28 20:00:00+00:00

- ``adapters``: one row per registered adapter (``tollgate.models.Adapter``), served as the model
  ``ft:<base>:<tenant>:<name>:<id>``. A tenant's live adapters have distinct names (a partial unique
  index over the rows not deleted); deleted rows stay, since the ledger names their models.
- ``files.purpose`` also takes ``fine-tune``: an adapter bundle uploaded to be registered.

Downgrade drops the table and refuses nothing: bundle files are deleted first, so the old purpose check
holds again.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("tenant_id", sa.BigInteger, sa.ForeignKey("tenants.id", ondelete="CASCADE",
                                                              name=op.f("fk_adapters_tenant_id_tenants")),
                  nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("base_model", sa.String(128), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("target_modules", postgresql.ARRAY(sa.Text), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("file_id", sa.String(64)),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("deleted_at", sa.DateTime(timezone=True)),
        sa.CheckConstraint("rank > 0 AND bytes >= 0", name=op.f("ck_adapters_sizes")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapters")),
        sa.UniqueConstraint("model", name=op.f("uq_adapters_model")),
    )
    op.create_index("ix_adapters_tenant_id_name_live", "adapters", ["tenant_id", "name"], unique=True,
                    postgresql_where=sa.text("deleted_at IS NULL"))
    op.create_index("ix_adapters_tenant_id_created_at", "adapters", ["tenant_id", "created_at"])
    op.drop_constraint(op.f("ck_files_purpose"), "files", type_="check")
    op.create_check_constraint(op.f("ck_files_purpose"), "files",
                               "purpose IN ('batch', 'batch_output', 'fine-tune')")


def downgrade() -> None:
    op.execute("DELETE FROM files WHERE purpose = 'fine-tune'")
    op.drop_constraint(op.f("ck_files_purpose"), "files", type_="check")
    op.create_check_constraint(op.f("ck_files_purpose"), "files", "purpose IN ('batch', 'batch_output')")
    op.drop_table("adapters")
