"""Keyset pagination in ``(created_at, id)`` order, the order of OpenAI's list endpoints (files,
batches): a page is the rows strictly after the cursor row, so pages neither skip nor repeat rows while
others are inserted or deleted, and the query starts from the cursor in the tables' ``(tenant_id,
created_at)`` index instead of counting an ``OFFSET``. Ties on ``created_at`` are broken by ``id``."""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import Select, tuple_
from sqlalchemy.ext.asyncio import AsyncSession

Row = TypeVar("Row")


async def keyset_page(session: AsyncSession, statement: Select[Row], model: Any, cursor: Any | None,
                      *, limit: int, descending: bool) -> tuple[list[Row], bool]:  # fmt: skip
    """Up to ``limit`` rows of ``statement`` (a ``select(model)`` with the caller's filters) after
    ``cursor`` (a row of ``model``, or None for the first page), and whether more follow."""
    key = tuple_(model.created_at, model.id)
    if cursor is not None:
        after = (cursor.created_at, cursor.id)
        statement = statement.where(key < after if descending else key > after)
    order = (model.created_at.desc(), model.id.desc()) if descending else (model.created_at, model.id)
    rows = list(await session.scalars(statement.order_by(*order).limit(limit + 1)))
    return rows[:limit], len(rows) > limit
