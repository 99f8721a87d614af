"""Priced once: the ledger stores each request's cost per token kind; the rollups are plain sums of it.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-28 17:00:00+00:00

Until now a ledger row held only its total cost, and the rollups found each kind's share again by
searching the price rows in effect around the row's time for one that reproduced the total (apportioning
it when none did). Gateways now charge a request once, per kind (``billing.prices.charge``), and the
ledger keeps what they charged:
- ``usage_events`` gains ``<kind>_cost_pico_usd`` for each priced kind (input, cached_input, output,
  cache_write, cache_pinned, cache_retained), BIGINT, default 0, checked to be non-negative and to add up
  to ``cost_pico_usd`` (``ck_usage_events_kind_costs``). Existing rows are filled here, once, by the
  search the rollups used to run on every flush (frozen below, as it was): that is exactly the split their
  buckets already hold, so the statements, the Usage and Costs APIs and the Stripe exports read the same
  amounts after the upgrade, to the pico-dollar.
- Every usage count of the ledger defaults to 0 (``prompt_tokens`` and ``completion_tokens`` had none), as
  a count added by a later kind does.
- ``usage_hourly`` takes the ledger's column names: ``input_tokens`` (the prompt less its cached part),
  ``cached_input_tokens`` and ``output_tokens`` give way to ``prompt_tokens``, ``cached_tokens`` and
  ``completion_tokens``, and the cached tiers' counts join; the buckets are rebuilt from the ledger as
  sums.

Downgrade restores the rollups' old columns from the ledger and drops the per-kind costs.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_KINDS = ("input", "cached_input", "output", "cache_write", "cache_pinned", "cache_retained")
_COSTS = tuple(f"{kind}_cost_pico_usd" for kind in _KINDS)
_CACHE_TOKENS = ("cache_write_tokens", "cache_pinned_tokens", "cache_retained_tokens")
_NEW_HOURLY_COUNTS = ("prompt_tokens", "cached_tokens", "cached_host_tokens", "cached_disk_tokens",
                      "completion_tokens")
_SUMMED = ("prompt_tokens", "cached_tokens", "cached_host_tokens", "cached_disk_tokens", *_CACHE_TOKENS,
           "completion_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens", *_COSTS,
           "cost_pico_usd")
_CHECK = "ck_usage_events_kind_costs"
_ADMISSION_WINDOW = timedelta(hours=1)
_BATCH = 5000


# -- the split the rollups searched for (billing/rollups.py before this revision) ----------------------
def _per_token(price: dict[str, int], request_class: str) -> tuple[int, ...]:
    prefix = "batch_" if request_class == "batch" else ""
    return tuple(price[prefix + name] for name in ("input", "cached_input", "output", "cache_write",
                                                    "cache_pin", "cache_retention"))


def _apportion(total: int, weights: Sequence[int]) -> list[int]:
    weight_sum = sum(weights)
    if weight_sum <= 0:
        return [total] + [0] * (len(weights) - 1)
    shares = [total * w // weight_sum for w in weights]
    remainders = sorted(range(len(weights)), key=lambda i: (-(total * weights[i] % weight_sum), i))
    for i in remainders[: total - sum(shares)]:
        shares[i] += 1
    return shares


class _Prices:
    def __init__(self, rows: Sequence[Any]) -> None:
        self.starts: dict[str, list[datetime]] = {}
        self.prices: dict[str, list[dict[str, int]]] = {}
        for row in rows:  # ordered by model, effective_from
            self.starts.setdefault(row.model, []).append(row.effective_from)
            self.prices.setdefault(row.model, []).append(dict(row._mapping))

    def candidates(self, model: str, at: datetime) -> list[dict[str, int]]:
        starts = self.starts.get(model, [])
        i = bisect.bisect_right(starts, at) - 1
        out = []
        while i >= 0:
            out.append(self.prices[model][i])
            if starts[i] <= at - _ADMISSION_WINDOW:
                break
            i -= 1
        return out

    def split(self, row: Any) -> tuple[int, ...]:
        cached = row.cached_tokens
        kinds = (row.prompt_tokens - cached, cached, row.completion_tokens,
                 *(getattr(row, name) for name in _CACHE_TOKENS))
        candidates = self.candidates(row.model, row.created_at)
        for price in candidates:
            per_token = _per_token(price, row.request_class)
            splits = [tuple(n * p for n, p in zip(kinds, per_token, strict=True))]
            if not any(kinds[2:]):
                embedding = price[("batch_" if row.request_class == "batch" else "") + "embedding_input"]
                splits.append(((kinds[0] + kinds[1]) * embedding, 0, 0, 0, 0, 0))
            for parts in splits:
                if sum(parts) == row.cost_pico_usd:
                    return parts
        if candidates:
            newest = _per_token(candidates[0], row.request_class)
            weights = [n * p for n, p in zip(kinds, newest, strict=True)]
        else:
            weights = list(kinds)
        return tuple(_apportion(row.cost_pico_usd, weights))


def _fill_ledger_costs(conn: sa.Connection) -> None:
    prices = _Prices(conn.execute(sa.text("SELECT * FROM prices ORDER BY model, effective_from")).all())
    last: tuple[datetime, int] | None = None
    while True:
        after = "" if last is None else "WHERE (created_at, id) > (:at, :id)"
        rows = conn.execute(sa.text(
            "SELECT id, created_at, model, request_class, prompt_tokens, cached_tokens, completion_tokens, "
            f"{', '.join(_CACHE_TOKENS)}, cost_pico_usd FROM usage_events {after} "
            f"ORDER BY created_at, id LIMIT {_BATCH}"), {} if last is None else {"at": last[0], "id": last[1]}
        ).all()
        if not rows:
            return
        updates = [{"id": r.id, "at": r.created_at, **dict(zip(_COSTS, prices.split(r), strict=True))}
                   for r in rows if r.cost_pico_usd]
        if updates:
            conn.execute(sa.text(
                f"UPDATE usage_events SET {', '.join(f'{c} = :{c}' for c in _COSTS)} "
                "WHERE id = :id AND created_at = :at"), updates)
        last = (rows[-1].created_at, rows[-1].id)


def _rebuild_hourly(conn: sa.Connection, columns: dict[str, str]) -> None:
    """Every bucket again from the ledger (``columns``: rollup column → the ledger expression it sums)."""
    conn.execute(sa.text("DELETE FROM usage_hourly"))
    conn.execute(sa.text(
        f"INSERT INTO usage_hourly (tenant_id, hour, model, request_class, requests, {', '.join(columns)}) "
        "SELECT tenant_id, date_trunc('hour', created_at, 'UTC'), model, request_class, count(*), "
        f"{', '.join(f'sum({expr})' for expr in columns.values())} FROM usage_events "
        "GROUP BY tenant_id, date_trunc('hour', created_at, 'UTC'), model, request_class"))


def upgrade() -> None:
    conn = op.get_bind()
    for name in ("prompt_tokens", "completion_tokens"):
        op.alter_column("usage_events", name, server_default=sa.text("0"))
    for name in _COSTS:
        op.add_column("usage_events", sa.Column(name, sa.BigInteger(), server_default=sa.text("0"),
                                                nullable=False))
    _fill_ledger_costs(conn)
    op.create_check_constraint(op.f(_CHECK), "usage_events",
                               " AND ".join(f"{name} >= 0" for name in _COSTS)
                               + f" AND {' + '.join(_COSTS)} = cost_pico_usd")

    for name in ("input_tokens", "cached_input_tokens", "output_tokens"):
        op.drop_column("usage_hourly", name)
    for name in _NEW_HOURLY_COUNTS:
        op.add_column("usage_hourly", sa.Column(name, sa.BigInteger(), server_default=sa.text("0"),
                                                nullable=False))
    for name in ("input_cost_pico_usd", "cached_input_cost_pico_usd", "output_cost_pico_usd"):
        op.alter_column("usage_hourly", name, server_default=sa.text("0"))
    _rebuild_hourly(conn, {name: name for name in _SUMMED})


def downgrade() -> None:
    conn = op.get_bind()
    for name in ("input_cost_pico_usd", "cached_input_cost_pico_usd", "output_cost_pico_usd"):
        op.alter_column("usage_hourly", name, server_default=None)
    for name in ("input_tokens", "cached_input_tokens", "output_tokens"):
        op.add_column("usage_hourly", sa.Column(name, sa.BigInteger(), server_default=sa.text("0"),
                                                nullable=False))
        op.alter_column("usage_hourly", name, server_default=None)
    old = {"input_tokens": "prompt_tokens - cached_tokens", "cached_input_tokens": "cached_tokens",
           "output_tokens": "completion_tokens"}
    _rebuild_hourly(conn, {**old, **{name: name for name in (*_CACHE_TOKENS, "accepted_prediction_tokens",
                                                              "rejected_prediction_tokens", *_COSTS,
                                                              "cost_pico_usd")}})
    for name in _NEW_HOURLY_COUNTS:
        op.drop_column("usage_hourly", name)
    op.drop_constraint(op.f(_CHECK), "usage_events", type_="check")
    for name in _COSTS:
        op.drop_column("usage_events", name)
    for name in ("prompt_tokens", "completion_tokens"):
        op.alter_column("usage_events", name, server_default=None)
