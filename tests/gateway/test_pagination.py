"""Keyset pagination (``gateway.pagination``) on real Postgres: rows sharing a ``created_at`` are neither
skipped nor repeated across pages, in both orders, and a row added mid-walk does not shift the pages."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from gateway.files.repository import FileRepository
from gateway.pagination import keyset_page
from tests.factories import create_tenant
from tollgate.models import File

T0 = datetime(2026, 11, 1, tzinfo=UTC)


def _file(tenant_id: int, name: str, created_at: datetime) -> File:
    return File(id=f"file-{name}", tenant_id=tenant_id, purpose="batch", filename=f"{name}.jsonl", bytes=1,
                storage_key=name, created_at=created_at)  # fmt: skip


async def _walk(session, tenant_id: int, *, descending: bool, limit: int) -> list[list[str]]:
    pages, cursor = [], None
    statement = select(File).where(File.tenant_id == tenant_id)
    while True:
        rows, more = await keyset_page(session, statement, File, cursor, limit=limit, descending=descending)
        pages.append([r.id for r in rows])
        if not more:
            return pages
        cursor = rows[-1]


@pytest.mark.parametrize("descending", [False, True])
async def test_ties_on_created_at_are_ordered_by_id_across_page_boundaries(db_session, descending):
    tenant = await create_tenant(db_session)
    other = await create_tenant(db_session)
    # Five files at one instant, two later, one of another tenant in the middle.
    later = {"b0": T0 + timedelta(seconds=1), "b1": T0 + timedelta(seconds=2)}
    names = {f"a{i}": T0 for i in range(5)} | later
    db_session.add_all([_file(tenant.id, n, t) for n, t in names.items()] + [_file(other.id, "x", T0)])
    await db_session.flush()
    pages = await _walk(db_session, tenant.id, descending=descending, limit=2)
    expected = sorted((t, f"file-{n}") for n, t in names.items())
    ids = [i for _, i in (reversed(expected) if descending else expected)]
    assert [i for page in pages for i in page] == ids
    assert [len(p) for p in pages] == [2, 2, 2, 1]


async def test_a_row_added_during_the_walk_does_not_shift_later_pages(db_session):
    tenant = await create_tenant(db_session)
    db_session.add_all([_file(tenant.id, f"f{i}", T0 + timedelta(seconds=i)) for i in range(4)])
    await db_session.flush()
    repo = FileRepository(db_session, tenant.id)
    first, more = await repo.page(purpose=None, after=None, limit=2, descending=True)
    assert [f.id for f in first] == ["file-f3", "file-f2"] and more
    db_session.add(_file(tenant.id, "new", T0 + timedelta(hours=1)))  # newer: belongs before page one
    await db_session.flush()
    rest, more = await repo.page(purpose=None, after=first[-1].id, limit=2, descending=True)
    assert [f.id for f in rest] == ["file-f1", "file-f0"] and not more
    assert await repo.page(purpose=None, after="file-unknown", limit=2, descending=True) == ([], False)
