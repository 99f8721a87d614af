"""Every query on tenants, API keys and the audit log. Repositories flush, never commit."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from tollgate.models import ApiKey, AuditLog, Tenant


class TenantRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def get(self, tenant_id: int) -> Tenant | None:
        return await self.session.get(Tenant, tenant_id)

    async def get_by_name(self, name: str) -> Tenant | None:
        return await self.session.scalar(select(Tenant).where(Tenant.name == name))

    async def list(self, *, limit: int = 100, offset: int = 0) -> Sequence[Tenant]:
        result = await self.session.scalars(select(Tenant).order_by(Tenant.id).limit(limit).offset(offset))
        return result.all()

    async def add(self, tenant: Tenant) -> Tenant:
        self.session.add(tenant)
        await self.session.flush()
        await self.session.refresh(tenant)
        return tenant

    async def flush(self, tenant: Tenant) -> Tenant:
        await self.session.flush()
        await self.session.refresh(tenant)
        return tenant


class ApiKeyRepository:
    """API keys; the ``*_for_tenant`` methods are scoped to one tenant so no caller can cross tenants."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def get_by_prefix(self, prefix: str) -> tuple[ApiKey, Tenant] | None:
        row = (await self.session.execute(
            select(ApiKey, Tenant).join(Tenant, Tenant.id == ApiKey.tenant_id).where(ApiKey.prefix == prefix)
        )).first()
        return (row[0], row[1]) if row is not None else None

    async def get_for_tenant(self, tenant_id: int, key_id: int) -> ApiKey | None:
        return await self.session.scalar(
            select(ApiKey).where(ApiKey.tenant_id == tenant_id, ApiKey.id == key_id)
        )

    async def list_for_tenant(self, tenant_id: int) -> Sequence[ApiKey]:
        result = await self.session.scalars(
            select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.id)
        )
        return result.all()

    async def add(self, key: ApiKey) -> ApiKey:
        self.session.add(key)
        await self.session.flush()
        await self.session.refresh(key)
        return key

    async def revoke_for_tenant(self, tenant_id: int, key_id: int, at: datetime) -> ApiKey | None:
        """Set ``revoked_at`` (kept if already revoked); the key, or None if the tenant has no such key."""
        key = await self.get_for_tenant(tenant_id, key_id)
        if key is None:
            return None
        if key.revoked_at is None:
            key.revoked_at = at
            await self.session.flush()
        return key

    async def touch_last_used(self, key_ids: Sequence[int], at: datetime) -> None:
        if key_ids:
            await self.session.execute(
                update(ApiKey).where(ApiKey.id.in_(key_ids)).values(last_used_at=at)
            )


class AuditLogRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def record(self, actor: str, action: str, *, tenant_id: int | None = None,
                     details: dict[str, Any] | None = None) -> None:
        self.session.add(AuditLog(actor=actor, action=action, tenant_id=tenant_id, details=details or {}))
        await self.session.flush()
