"""Every usage query of the tenant usage API, scoped to one tenant in one place: a ``UsageRepository`` is
built from the authenticated tenant's id and adds it to every statement, so no endpoint can forget it.

Hourly and daily buckets read the hourly rollups (``usage_hourly``); minute buckets read the ledger.
Sums are taken as ``NUMERIC`` and returned as Python ints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Numeric, cast, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from billing.prices import Charge
from billing.rollups import SUMMED
from engine.usage import FIELDS, Usage
from tollgate.models import UsageEvent, UsageHourly


@dataclass(frozen=True, slots=True)
class UsageRow:
    """Usage and (from the rollups; none per minute) cost of one (time, model, class)."""

    at: datetime
    model: str
    request_class: str
    requests: int
    usage: Usage
    costs: Charge = field(default_factory=lambda: Charge({}))


def _n(column: Any) -> Any:
    return func.sum(cast(column, Numeric))


class UsageRepository:
    def __init__(self, session: AsyncSession, tenant_id: int) -> None:
        self.session = session
        self.tenant_id = tenant_id

    async def hourly(self, start: datetime, end: datetime, *, models: Sequence[str] | None = None,
                     request_class: str | None = None) -> list[UsageRow]:
        """Rollup rows with ``start <= hour < end``."""
        stmt = select(UsageHourly).where(UsageHourly.tenant_id == self.tenant_id, UsageHourly.hour >= start,
                                         UsageHourly.hour < end)
        if models:
            stmt = stmt.where(UsageHourly.model.in_(list(models)))
        if request_class is not None:
            stmt = stmt.where(UsageHourly.request_class == request_class)
        rows = (await self.session.scalars(stmt.order_by(UsageHourly.hour))).all()
        out = []
        for r in rows:
            sums = {name: getattr(r, name) for name in SUMMED}
            out.append(UsageRow(r.hour, r.model, r.request_class, r.requests, Usage.from_fields(sums),
                                Charge.from_fields(sums)))
        return out

    async def by_minute(self, start: datetime, end: datetime, *, models: Sequence[str] | None = None,
                        request_class: str | None = None) -> list[UsageRow]:
        """Ledger usage per minute with ``start <= created_at < end`` (no costs)."""
        minute = func.date_trunc("minute", UsageEvent.created_at, "UTC")
        stmt = (select(minute, UsageEvent.model, UsageEvent.request_class, func.count(),
                       *(_n(getattr(UsageEvent, name)) for name in FIELDS))
                .where(UsageEvent.tenant_id == self.tenant_id, UsageEvent.created_at >= start,
                       UsageEvent.created_at < end)
                .group_by(minute, UsageEvent.model, UsageEvent.request_class))
        if models:
            stmt = stmt.where(UsageEvent.model.in_(list(models)))
        if request_class is not None:
            stmt = stmt.where(UsageEvent.request_class == request_class)
        return [UsageRow(at, model, klass, int(n),
                         Usage.from_fields({name: int(v) for name, v in zip(FIELDS, counts, strict=True)}))
                for at, model, klass, n, *counts in (await self.session.execute(stmt)).all()]
