"""Billing test fixtures: ``database``, a ``tollgate.db.Database`` on the test's own ``new_database`` (for
tests where background jobs, webhooks or the gateway commit), disposed after the test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tollgate.db import Database


@pytest.fixture
async def database(new_database: str) -> AsyncIterator[Database]:
    db = Database(new_database, pool_size=2)
    yield db
    await db.dispose()
