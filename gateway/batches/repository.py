"""Tenant-scoped queries on ``batches`` (the public API's view). ``BatchRepository`` builds every
statement from its tenant, so no endpoint can see or cancel another tenant's batch. The runner's
system-wide queries (claims, leases, sweeps) live in ``gateway.batch_runner.repository``."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.pagination import keyset_page
from tollgate.models import Batch


class BatchRepository:
    def __init__(self, session: AsyncSession, tenant_id: int) -> None:
        self.session = session
        self.tenant_id = tenant_id

    async def add(self, batch: Batch) -> Batch:
        if batch.tenant_id != self.tenant_id:
            raise ValueError("a batch must belong to the repository's tenant")
        self.session.add(batch)
        await self.session.flush()
        await self.session.refresh(batch)
        return batch

    async def get(self, batch_id: str, *, for_update: bool = False) -> Batch | None:
        statement = select(Batch).where(Batch.id == batch_id, Batch.tenant_id == self.tenant_id)
        if for_update:
            statement = statement.with_for_update()
        return await self.session.scalar(statement)

    async def page(self, *, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """Newest first; ``after`` is the id of the last batch of the previous page."""
        statement = select(Batch).where(Batch.tenant_id == self.tenant_id)
        cursor = None
        if after is not None:
            cursor = await self.get(after)
            if cursor is None:
                return [], False
        return await keyset_page(self.session, statement, Batch, cursor, limit=limit, descending=True)
