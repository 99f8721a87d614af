"""Where cached tokens came from: ``usage_events.cached_host_tokens`` and ``cached_disk_tokens``.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25 11:00:00+00:00

Of a request's ``cached_tokens``, the engine now says how many it loaded back from its host-memory tier
and read from its disk tier (the rest were in the device pool): the per-tenant hit rate by tier on the
dashboard's cache page. INTEGER like the other token counts, default 0 (earlier rows had no tiers to
tell apart), checked to add up to at most ``cached_tokens``. The ledger is partitioned by month: the
columns and the constraint added to the parent reach every partition, and later partitions
(``billing.partitions``: ``LIKE usage_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS``) copy them.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = ("cached_host_tokens", "cached_disk_tokens")
_CHECK = "ck_usage_events_cached_tier_counts"


def upgrade() -> None:
    for name in _COLUMNS:
        column = sa.Column(name, sa.Integer(), server_default=sa.text("0"), nullable=False)
        op.add_column("usage_events", column)
    op.create_check_constraint(
        op.f(_CHECK), "usage_events",
        "cached_host_tokens >= 0 AND cached_disk_tokens >= 0"
        " AND cached_host_tokens + cached_disk_tokens <= cached_tokens")


def downgrade() -> None:
    op.drop_constraint(op.f(_CHECK), "usage_events", type_="check")
    for name in reversed(_COLUMNS):
        op.drop_column("usage_events", name)
