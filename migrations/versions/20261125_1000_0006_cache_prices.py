"""Prompt-cache products: their prices on ``prices`` and their token counts on the ledger and rollups.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25 10:00:00+00:00

Cache writes, pins (``prompt_cache_options.ttl``) and retention (``prompt_cache_retention: "24h"``) are
priced per prompt token on top of the input prices (``billing.prices``):
- ``prices`` gains ``cache_write``, ``cache_pin``, ``cache_retention`` and their batch counterparts,
  server default 0 (what every existing row charged for them), covered by ``ck_prices_non_negative``.
- ``usage_events`` gains ``cache_write_tokens``, ``cache_pinned_tokens``, ``cache_retained_tokens``
  (INTEGER like the other token counts, default 0), each checked to be 0..``prompt_tokens`` by
  ``ck_usage_events_cache_token_counts``. The ledger is partitioned by month: columns and constraints
  added to the parent reach every partition, and monthly partitions created later
  (``billing.partitions``: ``LIKE usage_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS``) copy them.
- ``usage_hourly`` gains those counts (BIGINT sums) and their exact costs, default 0: an existing
  bucket's rows had no cache products.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_NON_NEGATIVE = (
    "input >= 0 AND cached_input >= 0 AND output >= 0 AND batch_input >= 0"
    " AND batch_cached_input >= 0 AND batch_output >= 0 AND embedding_input >= 0"
    " AND batch_embedding_input >= 0"
)
_CACHE_PRODUCTS = ("cache_write", "cache_pin", "cache_retention")
_CACHE_PRICE_COLUMNS = _CACHE_PRODUCTS + tuple(f"batch_{name}" for name in _CACHE_PRODUCTS)
_CACHE_TOKEN_COLUMNS = ("cache_write_tokens", "cache_pinned_tokens", "cache_retained_tokens")
_CACHE_COST_COLUMNS = tuple(name.replace("_tokens", "_cost_pico_usd") for name in _CACHE_TOKEN_COLUMNS)
_CACHE_TOKEN_COUNTS = " AND ".join(f"{name} BETWEEN 0 AND prompt_tokens" for name in _CACHE_TOKEN_COLUMNS)
_CACHE_TOKEN_CHECK = "ck_usage_events_cache_token_counts"


def _replace_non_negative(condition: str) -> None:
    op.drop_constraint(op.f("ck_prices_non_negative"), "prices", type_="check")
    op.create_check_constraint(op.f("ck_prices_non_negative"), "prices", condition)


def _add_zero_columns(table: str, names: Sequence[str], column_type: type[sa.Integer]) -> None:
    for name in names:
        op.add_column(table, sa.Column(name, column_type(), server_default=sa.text("0"), nullable=False))


def upgrade() -> None:
    _add_zero_columns("prices", _CACHE_PRICE_COLUMNS, sa.BigInteger)
    _replace_non_negative(_NON_NEGATIVE + "".join(f" AND {name} >= 0" for name in _CACHE_PRICE_COLUMNS))
    _add_zero_columns("usage_events", _CACHE_TOKEN_COLUMNS, sa.Integer)
    op.create_check_constraint(op.f(_CACHE_TOKEN_CHECK), "usage_events", _CACHE_TOKEN_COUNTS)
    _add_zero_columns("usage_hourly", _CACHE_TOKEN_COLUMNS + _CACHE_COST_COLUMNS, sa.BigInteger)


def downgrade() -> None:
    for name in reversed(_CACHE_TOKEN_COLUMNS + _CACHE_COST_COLUMNS):
        op.drop_column("usage_hourly", name)
    op.drop_constraint(op.f(_CACHE_TOKEN_CHECK), "usage_events", type_="check")
    for name in reversed(_CACHE_TOKEN_COLUMNS):
        op.drop_column("usage_events", name)
    _replace_non_negative(_NON_NEGATIVE)
    for name in reversed(_CACHE_PRICE_COLUMNS):
        op.drop_column("prices", name)
