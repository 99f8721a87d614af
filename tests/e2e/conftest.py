"""End-to-end fixtures: the whole platform, started once per test session and shared.

- ``platform`` (session): ``tollgate up --no-engine`` and a tiny engine replica, on a database and Redis
  index of its own (``tests/e2e/platform_harness.py``). Isolation between the tests that share it: each
  uses its own tenants and keys and looks only at its own request ids, batches and tenants.
- ``platform_db`` (session): a ``Database`` on the platform's database (tenants, the ledger).

Every test module that uses ``platform`` is marked ``xdist_group(platform_harness.PLATFORM_GROUP)``:
under ``pytest -n N --dist loadgroup`` (``make test``) one worker runs them all, one after the other,
and so starts the platform once (the grouping hook is in ``tests/conftest.py``).
``test_ledger_equality.py`` is not on it: it stops Postgres in the middle of its run, so it keeps its
own Postgres, Redis, gateway and synthetic engine (and may run on another worker meanwhile).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tests.e2e.platform_harness import Platform, start_platform
from tollgate.db import Database


@pytest.fixture(scope="session")
def platform(shared_servers: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with start_platform(shared_servers, tmp_path_factory.mktemp("platform")) as running:
        yield running


@pytest.fixture(scope="session")
async def platform_db(platform: Platform) -> AsyncIterator[Database]:
    db = Database(platform.database_url, pool_size=2)
    yield db
    await db.dispose()
