"""Suspending tenants for unpaid invoices and lifting it when they pay; telling every gateway.

Invariants:
- ``payment_failed_at`` records the first unpaid failure (a later failure never moves it forward);
  ``enforce_payment_grace`` suspends, reason ``billing``, every active tenant whose failure is older
  than the grace period. An admin's suspension is never overwritten (only active tenants are
  suspended) and never lifted (``lift_billing_suspension`` only touches reason ``billing``).
- Every change is written to ``audit_log`` (actor ``billing``) in the same transaction; services
  never commit.
- After the caller commits, ``publish_tenant_changed`` tells every gateway process to drop the
  tenant's cached limits, through ``tollgate.redis.publish_invalidation`` (the channel the gateway
  listens to).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from redis.asyncio import Redis
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from tollgate.models import AuditLog, Tenant
from tollgate.redis import publish_invalidation

ACTOR = "billing"


async def record_payment_failed(session: AsyncSession, tenant: Tenant, at: datetime) -> None:
    if tenant.payment_failed_at is None or at < tenant.payment_failed_at:
        tenant.payment_failed_at = at
        session.add(AuditLog(actor=ACTOR, action="billing.payment_failed", tenant_id=tenant.id,
                             details={"at": at.isoformat()}))
    await session.flush()


async def enforce_payment_grace(session: AsyncSession, *, now: datetime, grace_s: float,
                                tenant_ids: Iterable[int] | None = None) -> list[int]:
    """Suspend (reason ``billing``) active tenants unpaid for longer than the grace period."""
    stmt = (select(Tenant).where(Tenant.status == "active", Tenant.payment_failed_at.is_not(None),
                                 Tenant.payment_failed_at <= now - timedelta(seconds=grace_s))
            .order_by(Tenant.id).with_for_update())
    if tenant_ids is not None:
        stmt = stmt.where(Tenant.id.in_(list(tenant_ids)))
    suspended: list[int] = []
    for tenant in (await session.scalars(stmt)).all():
        tenant.status, tenant.suspended_reason = "suspended", "billing"
        session.add(AuditLog(actor=ACTOR, action="tenant.suspend", tenant_id=tenant.id,
                             details={"reason": "billing",
                                      "payment_failed_at": str(tenant.payment_failed_at)}))
        suspended.append(tenant.id)
    await session.flush()
    return suspended


async def lift_billing_suspension(session: AsyncSession, tenant: Tenant, paid_at: datetime) -> bool:
    """An invoice was paid: forget the failure (unless a newer one came after this payment) and lift a
    ``billing`` suspension. Returns whether the tenant was reactivated."""
    if tenant.payment_failed_at is not None and tenant.payment_failed_at <= paid_at:
        tenant.payment_failed_at = None
    reactivated = False
    if (tenant.status == "suspended" and tenant.suspended_reason == "billing"
            and tenant.payment_failed_at is None):
        tenant.status, tenant.suspended_reason = "active", None
        session.add(AuditLog(actor=ACTOR, action="tenant.resume", tenant_id=tenant.id,
                             details={"reason": "invoice paid"}))
        reactivated = True
    await session.flush()
    return reactivated


async def publish_tenant_changed(redis: Redis, tenant_ids: Iterable[int]) -> None:
    for tenant_id in tenant_ids:
        await publish_invalidation(redis, tenant_id=tenant_id)
