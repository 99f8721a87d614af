"""Predicted Outputs on the ledger: ``accepted_prediction_tokens`` and ``rejected_prediction_tokens``.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26 21:00:00+00:00

A chat completion with a ``prediction`` reports how many of the prediction's tokens made it into the
output and how many were thrown away; the rejected ones are counted in ``completion_tokens`` and billed as
output (as OpenAI bills them). Both now reach the ledger and its rollups:
- ``usage_events`` gains the two counts, INTEGER like the other token counts, server default 0 (earlier
  rows had no prediction to count), checked by ``ck_usage_events_prediction_token_counts`` to be
  non-negative and to add up to at most ``completion_tokens``. The ledger is partitioned by month: the
  columns and the constraint added to the parent reach every partition, and later partitions
  (``billing.partitions``: ``LIKE usage_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS``) copy them.
- ``usage_hourly`` gains their sums (BIGINT), default 0: an existing bucket's rows had none. They are
  part of ``output_tokens`` and have no cost columns of their own (never priced apart).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = ("accepted_prediction_tokens", "rejected_prediction_tokens")
_CHECK = "ck_usage_events_prediction_token_counts"


def _add_zero_columns(table: str, column_type: type[sa.Integer]) -> None:
    for name in _COLUMNS:
        op.add_column(table, sa.Column(name, column_type(), server_default=sa.text("0"), nullable=False))


def upgrade() -> None:
    _add_zero_columns("usage_events", sa.Integer)
    op.create_check_constraint(
        op.f(_CHECK), "usage_events",
        "accepted_prediction_tokens >= 0 AND rejected_prediction_tokens >= 0"
        " AND accepted_prediction_tokens + rejected_prediction_tokens <= completion_tokens")
    _add_zero_columns("usage_hourly", sa.BigInteger)


def downgrade() -> None:
    for name in reversed(_COLUMNS):
        op.drop_column("usage_hourly", name)
    op.drop_constraint(op.f(_CHECK), "usage_events", type_="check")
    for name in reversed(_COLUMNS):
        op.drop_column("usage_events", name)
