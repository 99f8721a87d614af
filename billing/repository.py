"""Every billing query: prices, the usage ledger, ledger sums. Repositories never commit."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Numeric, cast, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from billing.prices import PRICE_FIELDS, Price
from tollgate.models import Price as PriceRow
from tollgate.models import UsageEvent, UsageRequestId


def _price_of(row: PriceRow) -> Price:
    return Price(**{name: getattr(row, name) for name in PRICE_FIELDS})


async def all_prices(session: AsyncSession) -> list[tuple[str, datetime, Price]]:
    rows = (await session.scalars(select(PriceRow).order_by(PriceRow.model, PriceRow.effective_from))).all()
    return [(row.model, row.effective_from, _price_of(row)) for row in rows]


async def price_rows(session: AsyncSession, model: str) -> list[tuple[datetime, Price]]:
    stmt = select(PriceRow).where(PriceRow.model == model).order_by(PriceRow.effective_from)
    return [(row.effective_from, _price_of(row)) for row in (await session.scalars(stmt)).all()]


async def get_price_row(session: AsyncSession, model: str, effective_from: datetime) -> PriceRow | None:
    return await session.get(PriceRow, (model, effective_from))


async def upsert_price(session: AsyncSession, model: str, effective_from: datetime, price: Price) -> None:
    values = {name: getattr(price, name) for name in PRICE_FIELDS}
    stmt = insert(PriceRow).values(model=model, effective_from=effective_from, **values)
    await session.execute(stmt.on_conflict_do_update(index_elements=["model", "effective_from"], set_=values))


async def insert_usage_events(session: AsyncSession, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Insert ledger rows, skipping request ids already present; returns the rows inserted now.

    ``usage_events`` is partitioned by month, so it cannot hold a unique constraint on ``request_id``
    alone: the id is first claimed in the unpartitioned ``usage_request_ids`` (``ON CONFLICT DO
    NOTHING``), and only the rows whose id was claimed by this statement are inserted, in the same
    transaction. A concurrent transaction claiming the same id waits on the primary key until this one
    commits or rolls back, so exactly one ledger row per request id can ever commit."""
    if not rows:
        return []
    first: dict[str, dict[str, Any]] = {}
    for row in rows:
        first.setdefault(row["request_id"], row)
    claim = (insert(UsageRequestId)
             .values([{"request_id": rid, "created_at": row["created_at"]} for rid, row in first.items()])
             .on_conflict_do_nothing(index_elements=["request_id"]).returning(UsageRequestId.request_id))
    claimed = set((await session.scalars(claim)).all())
    fresh = [row for rid, row in first.items() if rid in claimed]
    if fresh:
        await session.execute(insert(UsageEvent).values(fresh))
    return fresh


async def spend_by_tenant(session: AsyncSession, start: datetime, end: datetime,
                          tenant_ids: Sequence[int] | None = None) -> dict[int, int]:
    """Ledger cost per tenant over ``[start, end)``, summed as NUMERIC (exact for any number of rows)."""
    total = func.sum(cast(UsageEvent.cost_pico_usd, Numeric))
    stmt = (select(UsageEvent.tenant_id, total)
            .where(UsageEvent.created_at >= start, UsageEvent.created_at < end)
            .group_by(UsageEvent.tenant_id))
    if tenant_ids is not None:
        stmt = stmt.where(UsageEvent.tenant_id.in_(tenant_ids))
    return {tenant_id: int(amount) for tenant_id, amount in (await session.execute(stmt)).all()}


async def count_usage_events(session: AsyncSession, request_ids: Sequence[str]) -> int:
    stmt = select(func.count()).select_from(UsageEvent).where(UsageEvent.request_id.in_(request_ids))
    return int((await session.scalar(stmt)) or 0)
