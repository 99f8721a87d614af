"""Monthly partitions of the ledger (``usage_events``, partitioned by ``RANGE (created_at)``).

Partitions live in the schema ``usage_partitions`` (``usage_events_YYYY_MM``, UTC months) next to a
default partition that catches any row no monthly partition covers, so an insert never fails for want
of a partition. ``ensure_usage_partitions`` (a daily beat task and ``tollgate up``'s migrations create
the first ones) creates the months from the current one to ``months_ahead`` ahead; rows of such a month
already sitting in the default partition are moved into the new partition in the same transaction
(Postgres refuses to attach a range the default partition holds rows of).
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from billing.spend import month_bounds, month_field

PARTITION_SCHEMA = "usage_partitions"
DEFAULT_PARTITION = f"{PARTITION_SCHEMA}.usage_events_default"


def partition_name(month: str) -> str:
    return f"usage_events_{month.replace('-', '_')}"


def next_month(month: str) -> str:
    year, mon = (int(part) for part in month.split("-"))
    return f"{year + (mon == 12):04d}-{mon % 12 + 1:02d}"


async def existing_partitions(session: AsyncSession) -> set[str]:
    rows = await session.execute(text(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = 'usage_events'"))
    return {name for (name,) in rows.all()}


async def ensure_usage_partitions(session: AsyncSession, *, at: datetime | None = None,
                                  months_ahead: int = 3) -> list[str]:
    """Create the missing monthly partitions from ``at``'s month to ``months_ahead`` later; returns the
    names created. Safe to run concurrently (a transaction-level advisory lock serialises runs)."""
    if months_ahead < 0:
        raise ValueError("months_ahead must be >= 0")
    await session.execute(text("SELECT pg_advisory_xact_lock(hashtext('tollgate:usage_partitions'))"))
    have = await existing_partitions(session)
    month = month_field(at or datetime.now(UTC))
    created: list[str] = []
    for _ in range(months_ahead + 1):
        name = partition_name(month)
        if name not in have:
            start, end = month_bounds(month)
            qualified = f"{PARTITION_SCHEMA}.{name}"
            await session.execute(text(
                f"CREATE TABLE {qualified} (LIKE usage_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"))
            await session.execute(text(
                f"WITH moved AS (DELETE FROM {DEFAULT_PARTITION} WHERE created_at >= :start "
                f"AND created_at < :end RETURNING *) INSERT INTO {qualified} SELECT * FROM moved"),
                {"start": start, "end": end})
            await session.execute(text(
                f"ALTER TABLE usage_events ATTACH PARTITION {qualified} "
                f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')"))
            created.append(name)
        month = next_month(month)
    return created
