"""Hourly usage rollups (``usage_hourly``), maintained incrementally and proved equal to the ledger.

A rollup row is keyed by (tenant, UTC hour, model, request class) and holds the request count and the
sums of the ledger's usage columns (``SUMMED``: every token kind's count and every priced kind's cost,
``engine.usage``, and the total ``cost_pico_usd``), under the ledger's own names. Nothing is priced
here: a ledger row carries what its request was charged per kind (``billing.prices.charge``).

Invariants:
- Incremental: ``add_to_rollups`` runs in the ledger flusher's transaction with exactly the rows that
  transaction inserted (``billing.repository.insert_usage_events`` returns them), as one
  ``INSERT … ON CONFLICT DO UPDATE SET x = x + excluded.x``, keys in a fixed order (no deadlocks
  between concurrent flushers). A redelivered record inserts no ledger row and adds nothing.
- Reconcile: ``reconcile_rollups`` takes the exclusive form of ``ROLLUP_LOCK`` (writers hold the
  shared form for their transaction), compares the rollups with ``GROUP BY`` sums of the ledger over a
  time range and rewrites every bucket that differs (missing, extra or wrong). While it holds the lock
  no ledger insert is in flight, so what it writes is the ledger's truth at its commit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Numeric, Select, cast, delete, func, select, tuple_
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from engine.usage import COST_FIELDS, FIELDS
from tollgate.models import UsageEvent, UsageHourly

# pg_advisory_xact_lock key: ledger writers hold it shared, the reconciler exclusive.
ROLLUP_LOCK = 0x70_11_6A_7E_0001

# The ledger columns a rollup sums, under the same names.
SUMMED = (*FIELDS, *COST_FIELDS, "cost_pico_usd")
_SUM_COLUMNS = ("requests", *SUMMED)

Key = tuple[int, datetime, str, str]


def hour_of(at: datetime) -> datetime:
    if at.tzinfo is None:
        raise ValueError("timestamps must be timezone-aware")
    return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def aggregate(rows: Iterable[Mapping[str, Any]]) -> dict[Key, dict[str, int]]:
    """The sums of ledger rows per bucket."""
    buckets: dict[Key, dict[str, int]] = {}
    for row in rows:
        key = (row["tenant_id"], hour_of(row["created_at"]), row["model"], row["request_class"])
        sums = buckets.setdefault(key, dict.fromkeys(_SUM_COLUMNS, 0))
        sums["requests"] += 1
        for name in SUMMED:
            sums[name] += row.get(name) or 0
    return buckets


async def hold_writer_lock(session: AsyncSession) -> None:
    """Taken by every ledger writer for its transaction: waits while a reconcile runs."""
    await session.execute(select(func.pg_advisory_xact_lock_shared(ROLLUP_LOCK)))


def _bucket_values(buckets: dict[Key, dict[str, int]]) -> list[dict[str, Any]]:
    return [{"tenant_id": k[0], "hour": k[1], "model": k[2], "request_class": k[3], **sums}
            for k, sums in sorted(buckets.items())]


async def add_to_rollups(session: AsyncSession, rows: Sequence[Mapping[str, Any]]) -> int:
    """Add freshly inserted ledger rows to their buckets; returns how many buckets changed."""
    if not rows:
        return 0
    values = _bucket_values(aggregate(rows))
    stmt = insert(UsageHourly).values(values)
    update = {name: getattr(UsageHourly, name) + getattr(stmt.excluded, name) for name in _SUM_COLUMNS}
    await session.execute(stmt.on_conflict_do_update(
        index_elements=["tenant_id", "hour", "model", "request_class"],
        set_={**update, "updated_at": func.now()}))
    return len(values)


@dataclass
class ReconcileResult:
    buckets_checked: int = 0
    repaired: list[Key] = field(default_factory=list)
    removed: list[Key] = field(default_factory=list)


def _ledger_sums(start: datetime, end: datetime, tenant_ids: Sequence[int] | None) -> Select[Any]:
    hour = func.date_trunc("hour", UsageEvent.created_at, "UTC").label("hour")
    stmt = (select(UsageEvent.tenant_id, hour, UsageEvent.model, UsageEvent.request_class,
                   func.count().label("requests"),
                   *(func.sum(cast(getattr(UsageEvent, name), Numeric)) for name in SUMMED))
            .where(UsageEvent.created_at >= start, UsageEvent.created_at < end)
            .group_by(UsageEvent.tenant_id, hour, UsageEvent.model, UsageEvent.request_class))
    if tenant_ids is not None:
        stmt = stmt.where(UsageEvent.tenant_id.in_(tenant_ids))
    return stmt


def _hour_range(start: datetime, end: datetime) -> tuple[datetime, datetime]:
    """The whole hours covering ``[start, end)``."""
    return hour_of(start), hour_of(end + timedelta(hours=1) - timedelta(microseconds=1))


async def _compare(session: AsyncSession, start: datetime, end: datetime, tenant_ids: Sequence[int] | None
                   ) -> tuple[int, dict[Key, tuple[int, ...]], list[Key], list[Key]]:
    """(buckets seen, the ledger's sums, buckets the rollups lack or have wrong, rollup buckets the ledger
    has no rows for)."""
    ledger: dict[Key, tuple[int, ...]] = {}
    for tenant_id, hour, model, klass, *sums in (await session.execute(
            _ledger_sums(start, end, tenant_ids))).all():
        ledger[(tenant_id, hour_of(hour), model, klass)] = tuple(int(v) for v in sums)
    stmt = select(UsageHourly).where(UsageHourly.hour >= start, UsageHourly.hour < end)
    if tenant_ids is not None:
        stmt = stmt.where(UsageHourly.tenant_id.in_(tenant_ids))
    rolled: dict[Key, tuple[int, ...]] = {}
    for r in (await session.scalars(stmt)).all():
        rolled[(r.tenant_id, hour_of(r.hour), r.model, r.request_class)] = tuple(
            getattr(r, name) for name in _SUM_COLUMNS)
    wrong = sorted(k for k, sums in ledger.items() if rolled.get(k) != sums)
    stale = sorted(k for k in rolled if k not in ledger)
    return len(ledger.keys() | rolled.keys()), ledger, wrong, stale


async def find_rollup_mismatches(session: AsyncSession, start: datetime, end: datetime, *,
                                 tenant_ids: Sequence[int] | None = None) -> list[Key]:
    """Buckets of ``[start, end)`` where rollups and ledger differ, without blocking ledger writers.

    Run it in a ``REPEATABLE READ`` transaction: both reads then see one snapshot, and since a writer
    commits its ledger rows and their rollup change together, a snapshot never shows half of one; so
    an empty answer proves equality and a non-empty one names buckets for ``reconcile_rollups``."""
    start, end = _hour_range(start, end)
    _, _, wrong, stale = await _compare(session, start, end, tenant_ids)
    return sorted(wrong + stale)


async def reconcile_rollups(session: AsyncSession, start: datetime, end: datetime, *,
                            tenant_ids: Sequence[int] | None = None) -> ReconcileResult:
    """Make the rollups of the whole hours in ``[start, end)`` equal to the ledger; returns what it fixed.
    Holds ``ROLLUP_LOCK`` exclusively until the caller's transaction ends (ledger writers wait)."""
    start, end = _hour_range(start, end)
    await session.execute(select(func.pg_advisory_xact_lock(ROLLUP_LOCK)))
    checked, ledger, wrong, stale = await _compare(session, start, end, tenant_ids)
    result = ReconcileResult(buckets_checked=checked)
    if stale:
        await session.execute(delete(UsageHourly).where(
            tuple_(UsageHourly.tenant_id, UsageHourly.hour, UsageHourly.model, UsageHourly.request_class)
            .in_(stale)))
        result.removed = stale
    if wrong:
        values = _bucket_values({k: dict(zip(_SUM_COLUMNS, ledger[k], strict=True)) for k in wrong})
        ins = insert(UsageHourly).values(values)
        await session.execute(ins.on_conflict_do_update(
            index_elements=["tenant_id", "hour", "model", "request_class"],
            set_={**{name: getattr(ins.excluded, name) for name in _SUM_COLUMNS}, "updated_at": func.now()}))
        result.repaired = wrong
    return result
