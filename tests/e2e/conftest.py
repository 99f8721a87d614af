"""End-to-end fixtures: the whole platform, started once per test session and shared.

- ``platform`` (session): ``tollgate up --no-engine`` and a tiny engine replica, on a database and Redis
  index of its own (``tests/e2e/platform_harness.py``). Isolation between the tests that share it: each
  uses its own tenants and keys and looks only at its own request ids, batches and tenants.
- ``platform_db`` (session): a ``Database`` on the platform's database (tenants, the ledger).

Every test module that uses ``platform`` is marked ``xdist_group(platform_harness.PLATFORM_GROUP)``:
under ``pytest -n N --dist loadgroup`` (``make test``) one worker runs them all, one after the other,
and so starts the platform once. ``test_ledger_equality.py`` is not on it: it stops Postgres in the
middle of its run, so it keeps its own Postgres, Redis, gateway and synthetic engine (and may run on
another worker meanwhile).

pytest 9.2 keeps node ids in ``Item._id``; pytest-xdist 3.8 still appends the group to the retired
``_nodeid``, so ``--dist loadgroup`` no longer sees any group (pytest-dev/pytest-xdist#1386) and would
spread these tests over the workers, each starting a platform. ``pytest_collection_modifyitems`` below
appends the group the way xdist meant to (its pending fix, #1388, does the same), for the tests of this
directory only; it does nothing where xdist's own suffix took effect.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.platform_harness import Platform, start_platform
from tollgate.db import Database

HERE = Path(__file__).resolve().parent


def _has_group_suffix(nodeid: str) -> bool:
    return nodeid.rfind("@") > nodeid.rfind("]")  # xdist's own test (scheduler/loadgroup.py)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "loadgroup", False):
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest before structured node ids: xdist's suffix works
        return
    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")})
        if groups and item.path.is_relative_to(HERE) and not _has_group_suffix(item.nodeid):
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def platform(shared_servers: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with start_platform(shared_servers, tmp_path_factory.mktemp("platform")) as running:
        yield running


@pytest.fixture(scope="session")
async def platform_db(platform: Platform) -> AsyncIterator[Database]:
    db = Database(platform.database_url, pool_size=2)
    yield db
    await db.dispose()
