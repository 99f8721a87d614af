"""Every query on ``responses`` (stored ``/v1/responses`` results).

``ResponseRepository`` builds every statement from its tenant and ignores rows past ``expires_at``, so no
request can read, continue or delete another tenant's response, nor one whose retention ended.
``conversation`` walks a response's ``previous_response_id`` chain in one recursive query, tenant-scoped
at every step, oldest first. ``delete_expired`` is beat's (system-wide).
"""

from __future__ import annotations

from datetime import datetime
from typing import cast

from sqlalchemy import Integer, Table, delete, func, literal, select
from sqlalchemy.ext.asyncio import AsyncSession

from tollgate.models import StoredResponse

# A conversation longer than this many responses is cut at its oldest end (a guard against a cycle,
# which ids generated here cannot form, and against unbounded prompts).
MAX_CHAIN = 1000
# The mapped table (a declarative class's ``__table__`` is typed as any ``FromClause``; this one is a
# ``Table``), and a Core statement built once (no ORM bookkeeping, no per-call statement building).
RESPONSES = cast(Table, StoredResponse.__table__)
_INSERT = RESPONSES.insert()
_COLUMNS = list(RESPONSES.columns)


class ResponseRepository:
    def __init__(self, session: AsyncSession, tenant_id: int) -> None:
        self.session = session
        self.tenant_id = tenant_id

    def _live(self):  # type: ignore[no-untyped-def]
        return (StoredResponse.tenant_id == self.tenant_id, StoredResponse.expires_at > func.now())

    async def add(self, row: StoredResponse) -> None:
        """Insert ``row`` (one statement, no ORM bookkeeping: this runs once per stored response)."""
        if row.tenant_id != self.tenant_id:
            raise ValueError("a response must belong to the repository's tenant")
        await self.session.execute(_INSERT, row_values(row))

    async def get(self, response_id: str, *, for_update: bool = False) -> StoredResponse | None:
        statement = select(StoredResponse).where(StoredResponse.id == response_id, *self._live())
        return await self.session.scalar(statement.with_for_update() if for_update else statement)

    async def conversation(self, response_id: str) -> list[StoredResponse]:
        """``response_id`` and the responses before it, oldest first (empty if it is not this tenant's)."""
        first = (select(StoredResponse.id, StoredResponse.previous_response_id,
                        literal(0, Integer).label("depth"))
                 .where(StoredResponse.id == response_id, *self._live())
                 .cte("chain", recursive=True))
        earlier = (select(StoredResponse.id, StoredResponse.previous_response_id, (first.c.depth + 1))
                   .join(first, StoredResponse.id == first.c.previous_response_id)
                   .where(*self._live(), first.c.depth < MAX_CHAIN))
        chain = first.union_all(earlier)
        rows = await self.session.execute(select(StoredResponse).join(chain, StoredResponse.id == chain.c.id)
                                          .order_by(chain.c.depth.desc()))
        return list(rows.scalars())

    async def delete(self, response_id: str) -> bool:
        result = await self.session.execute(delete(StoredResponse).where(StoredResponse.id == response_id,
                                                                         *self._live()))
        return bool(result.rowcount)  # type: ignore[attr-defined]


def row_values(row: StoredResponse) -> dict[str, object]:
    return {column.name: getattr(row, column.key) for column in _COLUMNS}


async def delete_expired(session: AsyncSession, now: datetime) -> int:
    result = await session.execute(delete(StoredResponse).where(StoredResponse.expires_at <= now))
    return int(result.rowcount)  # type: ignore[attr-defined]
