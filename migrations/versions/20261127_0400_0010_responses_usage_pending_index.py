"""A partial index for the background responses' left-behind usage records.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-27 04:00:00+00:00

Beat's ``responses.requeue`` sweep (every ``batch_sweep_interval_s``, 10 s by default) looks for the rows
whose ``usage_pending`` is set (``gateway.responses.background.meter_pending``). Without an index that is
a scan of every stored response (kept 30 days); ``ix_responses_usage_pending`` holds only those rows,
normally none.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_responses_usage_pending", "responses", ["id"],
                    postgresql_where=sa.text("usage_pending IS NOT NULL"))


def downgrade() -> None:
    op.drop_index("ix_responses_usage_pending", table_name="responses")
