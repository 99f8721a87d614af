"""Every usage query of the tenant usage API, scoped to one tenant in one place: a ``UsageRepository`` is
built from the authenticated tenant's id and adds it to every statement, so no endpoint can forget it.

Hourly and daily buckets read the hourly rollups (``usage_hourly``); minute buckets read the ledger.
Sums are taken as ``NUMERIC`` and returned as Python ints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Numeric, cast, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from billing.prices import CACHE_TOKEN_FIELDS
from billing.rollups import DETAIL_COLUMNS, KIND_COST_COLUMNS, KIND_TOKEN_COLUMNS
from tollgate.models import UsageEvent, UsageHourly


@dataclass(frozen=True, slots=True)
class UsageRow:
    """Usage (and, from the rollups, cost) of one (time, model, class)."""

    at: datetime
    model: str
    request_class: str
    requests: int
    input_tokens: int  # not served from the prompt cache
    cached_input_tokens: int
    output_tokens: int
    input_cost_pico_usd: int = 0
    cached_input_cost_pico_usd: int = 0
    output_cost_pico_usd: int = 0
    # Prompt tokens the cache products were charged on (counted in the input kinds too), and their cost.
    cache_write_tokens: int = 0
    cache_pinned_tokens: int = 0
    cache_retained_tokens: int = 0
    cache_write_cost_pico_usd: int = 0
    cache_pinned_cost_pico_usd: int = 0
    cache_retained_cost_pico_usd: int = 0
    # Predicted Outputs: of the output tokens, the prediction tokens accepted and rejected.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


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
        return [UsageRow(r.hour, r.model, r.request_class, r.requests,
                         **{name: getattr(r, name)
                            for name in (*KIND_TOKEN_COLUMNS, *KIND_COST_COLUMNS, *DETAIL_COLUMNS)})
                for r in rows]

    async def by_minute(self, start: datetime, end: datetime, *, models: Sequence[str] | None = None,
                        request_class: str | None = None) -> list[UsageRow]:
        """Ledger usage per minute with ``start <= created_at < end`` (no cost split)."""
        minute = func.date_trunc("minute", UsageEvent.created_at, "UTC")
        stmt = (select(minute, UsageEvent.model, UsageEvent.request_class, func.count(),
                       _n(UsageEvent.prompt_tokens - UsageEvent.cached_tokens), _n(UsageEvent.cached_tokens),
                       _n(UsageEvent.completion_tokens),
                       *(_n(getattr(UsageEvent, name)) for name in (*CACHE_TOKEN_FIELDS, *DETAIL_COLUMNS)))
                .where(UsageEvent.tenant_id == self.tenant_id, UsageEvent.created_at >= start,
                       UsageEvent.created_at < end)
                .group_by(minute, UsageEvent.model, UsageEvent.request_class))
        if models:
            stmt = stmt.where(UsageEvent.model.in_(list(models)))
        if request_class is not None:
            stmt = stmt.where(UsageEvent.request_class == request_class)
        return [UsageRow(at, model, klass, int(n), int(i), int(c), int(o),
                         **{name: int(v) for name, v in zip((*CACHE_TOKEN_FIELDS, *DETAIL_COLUMNS), counts,
                                                            strict=True)})
                for at, model, klass, n, i, c, o, *counts in (await self.session.execute(stmt)).all()]
