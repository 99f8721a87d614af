"""Billing logic over the repository: setting prices, seeding the demo model's price, reconciling the
month-to-date spend counters with the ledger. Services never commit; the caller's unit of work does.

Invariants:
- A price row that has taken effect is history: ledger rows were costed with it, so it is never
  rewritten. ``set_price`` adds a new row from ``effective_from`` (now by default) and may only replace
  a row that has not taken effect yet.
- ``ensure_price`` gives a model its first price, effective from the epoch, and never touches a model
  that has one (``tollgate up`` calls it for the tiny model on every start).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession

from billing import repository
from billing.prices import Price
from billing.spend import drop_months_before, month_bounds, month_field, raise_spend_to

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

# What ``tollgate up`` seeds for its tiny demo model ($0.10 / $0.01 cached / $0.40 per million tokens):
# an ordinary price row, shown by ``tollgate prices list`` and replaced with ``tollgate prices set``.
DEMO_PRICE = Price.of(input=100_000, output=400_000)


class PriceConflict(ValueError):
    """The price row at that date has already taken effect and cannot be changed."""


async def set_price(session: AsyncSession, model: str, price: Price, effective_from: datetime | None = None,
                    *, now: datetime | None = None) -> datetime:
    """Add (or replace a not-yet-effective) price row; returns its ``effective_from``."""
    now = now or datetime.now(UTC)
    start = effective_from or now
    if start.tzinfo is None:
        raise ValueError("effective_from must be timezone-aware")
    if not model or len(model) > 128:
        raise ValueError("model must be 1..128 characters")
    if start <= now and await repository.get_price_row(session, model, start) is not None:
        raise PriceConflict(f"the price of {model!r} effective {start.isoformat()} is already in effect; "
                            "add a new row with a later --effective-from")
    await repository.upsert_price(session, model, start, price)
    return start


async def ensure_price(session: AsyncSession, model: str, price: Price) -> bool:
    """Give ``model`` its first price (effective since the epoch); False if it already has one."""
    if await repository.price_rows(session, model):
        return False
    await repository.upsert_price(session, model, EPOCH, price)
    return True


async def reconcile_month_spend(session: AsyncSession, redis: Redis, *, at: datetime | None = None) -> int:
    """Raise every tenant's month-to-date spend counter in Redis to at least the ledger's sum for the
    month of ``at`` (now by default) and forget counters older than the previous month. Returns how
    many tenants' counters now equal their ledger sum (raised, or already exact; a counter ahead of
    the ledger counts usage still in the outbox)."""
    month = month_field(at or datetime.now(UTC))
    start, end = month_bounds(month)
    exact = 0
    for tenant_id, total in (await repository.spend_by_tenant(session, start, end)).items():
        after = await raise_spend_to(redis, tenant_id, month, total)
        exact += after == total
        await drop_months_before(redis, tenant_id, month_field(start - timedelta(days=1)))
    return exact
