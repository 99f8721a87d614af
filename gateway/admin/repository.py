"""Every query the admin API adds: admins, tenant search, usage sums, the audit log. Repositories flush,
never commit. (Tenant/key writes go through ``gateway.tenants.repository``, prices through
``billing.repository``.)

Usage sums are exact: token counts are summed as BIGINT, costs as NUMERIC; time buckets are UTC hours
or days (``date_trunc(unit, created_at, 'UTC')``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from sqlalchemy import ColumnElement, Numeric, cast, func, literal_column, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from engine.usage import FIELDS, Usage
from tollgate.models import Admin, AuditLog, Tenant, UsageEvent

_USAGE_COLUMNS = {
    "model": UsageEvent.model,
    "request_class": UsageEvent.request_class,
    "tenant_id": UsageEvent.tenant_id,
    "tier": UsageEvent.tier,
}
USAGE_DIMENSIONS = tuple(_USAGE_COLUMNS)
USAGE_GRANULARITIES = ("hour", "day")


def _escape_like(term: str) -> str:
    return term.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


class AdminRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def get_by_email(self, email: str) -> Admin | None:
        return await self.session.scalar(select(Admin).where(Admin.email == email))

    async def get_by_token_hash(self, token_hash: str) -> Admin | None:
        return await self.session.scalar(select(Admin).where(Admin.api_token_hash == token_hash))

    async def list(self) -> Sequence[Admin]:
        return (await self.session.scalars(select(Admin).order_by(Admin.id))).all()

    async def add(self, admin: Admin) -> Admin:
        self.session.add(admin)
        await self.session.flush()
        await self.session.refresh(admin)
        return admin

    async def flush(self) -> None:
        await self.session.flush()

    async def delete(self, admin: Admin) -> None:
        await self.session.delete(admin)
        await self.session.flush()


async def lock_tenant(session: AsyncSession, tenant_id: int) -> Tenant | None:
    """The tenant row, locked (``FOR UPDATE``) until the transaction ends, so a status change decided on
    what was read cannot race another writer (e.g. billing suspending the tenant meanwhile)."""
    stmt = select(Tenant).where(Tenant.id == tenant_id).with_for_update()
    return await session.scalar(stmt.execution_options(populate_existing=True))


async def search_tenants(session: AsyncSession, *, search: str | None, status: str | None,
                         limit: int, offset: int) -> tuple[Sequence[Tenant], int]:
    """A page of tenants (by id) whose name contains ``search`` (case-insensitive) or whose id equals it,
    optionally only those with ``status``; and how many match in all."""
    conditions: list[ColumnElement[bool]] = []
    if search:
        matches: list[ColumnElement[bool]] = [Tenant.name.ilike(f"%{_escape_like(search)}%", escape="\\")]
        if search.isdigit() and len(search) <= 18:
            matches.append(Tenant.id == int(search))
        conditions.append(or_(*matches))
    if status:
        conditions.append(Tenant.status == status)
    total = await session.scalar(select(func.count()).select_from(Tenant).where(*conditions))
    rows = await session.scalars(
        select(Tenant).where(*conditions).order_by(Tenant.id).limit(limit).offset(offset)
    )
    return rows.all(), int(total or 0)


@dataclass(frozen=True, slots=True)
class UsageSum:
    group: dict[str, object]
    bucket_start: datetime | None
    requests: int
    usage: Usage
    cost_pico_usd: int


async def usage_sums(session: AsyncSession, *, start: datetime, end: datetime, tenant_id: int | None,
                     group_by: Sequence[str], granularity: str | None) -> list[UsageSum]:
    """Sums of ``usage_events`` over ``[start, end)``, one row per group (one row in all when
    ``group_by`` is empty and ``granularity`` None; none when nothing matched)."""
    unknown = set(group_by) - set(_USAGE_COLUMNS)
    if unknown or (granularity is not None and granularity not in USAGE_GRANULARITIES):
        raise ValueError(f"cannot group usage by {sorted(unknown) or granularity}")
    keys: list[ColumnElement[object]] = [_USAGE_COLUMNS[name].label(name) for name in group_by]
    if granularity is not None:
        # The unit is one of two constants, inlined so the SELECT and GROUP BY expressions are identical.
        unit: ColumnElement[str] = literal_column(f"'{granularity}'")
        keys.insert(0, func.date_trunc(unit, UsageEvent.created_at, literal_column("'UTC'"))
                    .label("bucket_start"))
    stmt = (
        select(
            *keys,
            func.count().label("requests"),
            *(func.coalesce(func.sum(getattr(UsageEvent, n)), 0).label(n) for n in FIELDS),
            func.coalesce(func.sum(cast(UsageEvent.cost_pico_usd, Numeric)), 0).label("cost"),
        )
        .where(UsageEvent.created_at >= start, UsageEvent.created_at < end)
    )
    if tenant_id is not None:
        stmt = stmt.where(UsageEvent.tenant_id == tenant_id)
    if keys:
        stmt = stmt.group_by(*keys).order_by(*keys)
    result = []
    for row in (await session.execute(stmt)).mappings():
        if not keys and row["requests"] == 0:
            continue
        cost = row["cost"]
        result.append(UsageSum(
            group={name: row[name] for name in group_by},
            bucket_start=row["bucket_start"] if granularity is not None else None,
            requests=int(row["requests"]),
            usage=Usage.from_fields({name: int(row[name]) for name in FIELDS}),
            cost_pico_usd=int(cost if isinstance(cost, Decimal) else Decimal(cost)),
        ))
    return result


async def audit_entries(session: AsyncSession, *, tenant_id: int | None, action: str | None,
                        before_id: int | None, limit: int) -> Sequence[AuditLog]:
    """Newest first; ``before_id`` pages backwards."""
    stmt = select(AuditLog).order_by(AuditLog.id.desc()).limit(limit)
    if tenant_id is not None:
        stmt = stmt.where(AuditLog.tenant_id == tenant_id)
    if action is not None:
        stmt = stmt.where(AuditLog.action == action)
    if before_id is not None:
        stmt = stmt.where(AuditLog.id < before_id)
    return (await session.scalars(stmt)).all()
