"""Every query on ``files``. ``FileRepository`` is bound to one tenant and builds every statement from
it, so no endpoint can read or delete another tenant's file; the retention helpers at the bottom are
system-wide (beat) and say so in their names."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.pagination import keyset_page
from tollgate.models import File


class FileRepository:
    def __init__(self, session: AsyncSession, tenant_id: int) -> None:
        self.session = session
        self.tenant_id = tenant_id

    async def add(self, file: File) -> File:
        if file.tenant_id != self.tenant_id:
            raise ValueError("a file must belong to the repository's tenant")
        self.session.add(file)
        await self.session.flush()
        await self.session.refresh(file)
        return file

    async def get(self, file_id: str) -> File | None:
        return await self.session.scalar(
            select(File).where(File.id == file_id, File.tenant_id == self.tenant_id))

    async def page(self, *, purpose: str | None, after: str | None, limit: int,
                   descending: bool) -> tuple[list[File], bool]:
        """Up to ``limit`` files in ``created_at`` order after the file ``after`` (a cursor of this
        tenant's; an unknown cursor yields an empty page), and whether more follow."""
        statement = select(File).where(File.tenant_id == self.tenant_id)
        if purpose is not None:
            statement = statement.where(File.purpose == purpose)
        cursor = None
        if after is not None:
            cursor = await self.get(after)
            if cursor is None:
                return [], False
        return await keyset_page(self.session, statement, File, cursor, limit=limit, descending=descending)

    async def delete(self, file_id: str) -> File | None:
        """Delete the row; returns it (its ``storage_key`` is for the caller to delete after commit)."""
        return await self.session.scalar(
            delete(File).where(File.id == file_id, File.tenant_id == self.tenant_id).returning(File))


async def delete_expired_files(session: AsyncSession, now: datetime, limit: int) -> Sequence[File]:
    """System-wide retention: delete up to ``limit`` file rows whose ``expires_at`` has passed and
    return them (their bytes are deleted after the commit)."""
    expired = (select(File.id).where(File.expires_at <= now).order_by(File.expires_at).limit(limit)
               .with_for_update(skip_locked=True))
    rows = await session.scalars(delete(File).where(File.id.in_(expired)).returning(File))
    return list(rows)
