"""A background response's usage record, kept with its final state until it is metered.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-27 02:00:00+00:00

A worker stored a background response's final state, then metered its usage: a worker killed between the
two left a response its tenant can read (``incomplete``, with its usage) and no ledger row (the chaos
benchmark found one). ``responses.usage_pending`` (JSONB, null) now holds the usage record the worker
meters next, written in the same update as the final state; the worker clears it once metered, and the
requeue sweep meters one left by a worker whose lease expired (the ledger keeps a request id once).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("responses", sa.Column("usage_pending", postgresql.JSONB(), nullable=True))


def downgrade() -> None:
    op.drop_column("responses", "usage_pending")
