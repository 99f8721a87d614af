"""Embedding prices: ``prices.embedding_input`` and ``prices.batch_embedding_input``.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 08:00:00+00:00

``/v1/embeddings`` requests (and batch lines targeting it) are priced per prompt token at the embedding
price instead of the chat input price (``billing.prices``). Existing rows keep what they charged: each
gets its own ``input`` and ``batch_input`` as its embedding prices, then the columns become NOT NULL and
``ck_prices_non_negative`` covers them.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_NON_NEGATIVE = ("input >= 0 AND cached_input >= 0 AND output >= 0 AND batch_input >= 0"
                 " AND batch_cached_input >= 0 AND batch_output >= 0")
_EMBEDDING_COLUMNS = ("embedding_input", "batch_embedding_input")


def _replace_non_negative(condition: str) -> None:
    op.drop_constraint(op.f("ck_prices_non_negative"), "prices", type_="check")
    op.create_check_constraint(op.f("ck_prices_non_negative"), "prices", condition)


def upgrade() -> None:
    for name in _EMBEDDING_COLUMNS:
        op.add_column("prices", sa.Column(name, sa.BigInteger(), nullable=True))
    op.execute("UPDATE prices SET embedding_input = input, batch_embedding_input = batch_input")
    for name in _EMBEDDING_COLUMNS:
        op.alter_column("prices", name, existing_type=sa.BigInteger(), nullable=False)
    _replace_non_negative(_NON_NEGATIVE + " AND embedding_input >= 0 AND batch_embedding_input >= 0")


def downgrade() -> None:
    _replace_non_negative(_NON_NEGATIVE)
    for name in reversed(_EMBEDDING_COLUMNS):
        op.drop_column("prices", name)
