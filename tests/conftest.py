"""Shared fixtures: real Postgres and Redis from the installed binaries (no Docker), started lazily.

Servers (``tollgate.local_services``, the same code ``tollgate up`` uses):
- Started by the first test that asks for ``database_url`` / ``redis_url`` (or a fixture built on
  them), once per pytest session, and shared by every xdist worker: the first worker starts them under a
  file lock, the others find them through a state file; the starting worker keeps them until every
  worker that used them is gone, then stops them (they die with it if it is killed). Tests that need
  neither (engine, kernels) never start them. Fsync is off: test data is disposable.
- Each xdist worker gets its own database ``tollgate_test_<worker>`` (recreated and migrated to head
  once) and its own Redis database index (``gw0`` → 1, ``gw1`` → 2, no xdist → 0).

Fixtures:
- ``settings``: test ``Settings`` (``environment="test"``, time constants shortened) made the value of
  ``get_settings()`` through ``TOLLGATE_*`` environment variables (so subprocesses inherit it). It starts
  no server. Override fields per test with ``@pytest.mark.settings(field=value, ...)``.
- ``service_settings``: ``settings`` plus the worker's ``database_url`` and ``redis_url``.
- ``database_url`` / ``redis_url`` (session): the worker's URLs.
- ``db`` (session): a ``tollgate.db.Database`` on the worker's database.
- ``db_session``: an ``AsyncSession`` inside a transaction that is rolled back after the test;
  ``commit()`` in code under test only releases a SAVEPOINT. ``db_sessionmaker`` makes sessions on the
  same connection and transaction (use them one at a time); ``unit_of_work`` makes sessions there that
  commit on exit, like ``Database.session`` (the commit releases a SAVEPOINT).
- ``redis_client``: an asyncio Redis client on the worker's database, flushed before each test.
- ``new_database``: a fresh migrated database for tests where other processes commit; dropped after.
- ``private_redis``: a Redis server of the test's own, for tests that stop it (``.stop()``).
Factories live in ``tests/factories.py`` (``create_tenant``, ``create_api_key``, ...).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import secrets
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

import tollgate.db
from tests.polling import wait_until
from tollgate.db import Database
from tollgate.local_services import (
    POSTGRES_STOP_SIGNAL,
    REDIS_STOP_SIGNAL,
    LocalPostgres,
    LocalRedis,
    find_server_binaries,
    free_port,
)
from tollgate.processes import pid_alive, spawn, stop, stop_pid
from tollgate.settings import Settings, get_settings

# One torch intra-op thread in every process of the run (pytest's workers, and through the environment
# the engines and ranks they start), unless the caller chose: the suite already runs a worker per core
# beside its engine subprocesses, so torch's default of a thread per core only oversubscribes the cores
# (its OpenMP threads spin while they wait), and the tiny test models gain nothing from a second thread.
# Set here, before any test module imports torch (OpenMP reads it when torch loads).
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:  # a plugin imported it first: OpenMP has read the environment already
        sys.modules["torch"].set_num_threads(1)

REDIS_DATABASES = 64
SERVER_START_TIMEOUT_S = 60.0

# Shortened time constants for every test (strings, as environment variables carry them).
TEST_ENV = {
    "TOLLGATE_ENVIRONMENT": "test",
    "TOLLGATE_HEALTH_CHECK_TIMEOUT_S": "1.0",
    "TOLLGATE_HEALTH_POLL_INTERVAL_S": "0.1",
    "TOLLGATE_HEARTBEAT_INTERVAL_S": "0.5",
    "TOLLGATE_BEAT_MAX_LOOP_INTERVAL_S": "0.5",
    "TOLLGATE_RESTART_BACKOFF_S": "0.2",
    "TOLLGATE_RESTART_BACKOFF_MAX_S": "1.0",
    "TOLLGATE_STOP_TIMEOUT_S": "10",
    "TOLLGATE_STARTUP_TIMEOUT_S": "120",
    "TOLLGATE_USAGE_FLUSH_INTERVAL_S": "0.2",
    "TOLLGATE_KEY_CACHE_TTL_S": "0.5",
    "TOLLGATE_DATABASE_POOL_SIZE": "5",
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "settings(**fields): override Settings fields for this test")
    # ``Settings.data_dir`` defaults to ``./.tollgate``: what the apps that tests build write there
    # (uploaded files, spooled usage) goes to a directory of this run's own (xdist workers inherit it),
    # not into the working tree, where a later run's gateway would find (and replay) it. Each test gets
    # a directory of its own (``_data_dir``); this one is for the session fixtures, set up before it.
    if "TOLLGATE_DATA_DIR" not in os.environ:
        os.environ["TOLLGATE_DATA_DIR"] = data_dir = tempfile.mkdtemp(prefix="tollgate-test-data-")
        config.add_cleanup(partial(shutil.rmtree, data_dir, ignore_errors=True))


def _has_group_suffix(nodeid: str) -> bool:
    return nodeid.rfind("@") > nodeid.rfind("]")  # xdist's own test (scheduler/loadgroup.py)


# Session fixtures that start servers (an engine process, a gateway) or a shared database: every test
# using one is grouped, so one worker starts them, not each (and ``STOPPED_AFTER_LAST_USER`` stops them
# once that worker is done with them).
SHARED_FIXTURES = {name: "gateway_session" for name in ("gateway", "engine_url", "api_database_url",
                                                          "model_price")}  # fmt: skip
# Some of the files gateway's tests use the engine too: one group, so the engine starts once.
SHARED_FIXTURES["files_gateway"] = "gateway_session"


def _implicit_group(item: pytest.Item) -> str | None:
    """The group of a test without an ``xdist_group`` mark: that of a shared fixture it uses,
    else its module's when it uses a module-scoped fixture of its module (which exists to be set up
    once). Without one, xdist spreads a module's tests over the workers and each sets it up again."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for name in info.names_closure:
        if name in SHARED_FIXTURES:
            return SHARED_FIXTURES[name]
    module_id = item.nodeid.split("::", 1)[0]
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name, ())
        if defs and defs[-1].scope == "module" and defs[-1].baseid == module_id:
            return "module_" + module_id.removesuffix(".py").replace("/", "_")
    return None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``xdist_group`` for every test: under ``pytest -n N --dist loadgroup`` (``make test``) a group's
    tests run on one worker, so what they share (the e2e platform, the dashboard's servers, the AOT
    compiles) is set up once. pytest 9.2 keeps node ids in ``Item._id``; pytest-xdist 3.8 still appends
    the group to the retired ``_nodeid``, so ``--dist loadgroup`` sees no group (pytest-dev/pytest-xdist
    #1386). This appends it the way xdist meant to (its pending fix, #1388, does the same), and does
    nothing where xdist's own suffix took effect. Tests without a mark get ``_implicit_group``'s.

    Modules holding a ``slow`` test also move to the front (whole, in their order): xdist hands out
    ungrouped tests in collection order, so a minute-long test collected last kept one worker busy
    while the other sat idle at the end of the run (~35-45 s of every full run)."""
    heavy = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in heavy)
    if not getattr(config.option, "loadgroup", False):
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest before structured node ids: xdist's suffix works
        return
    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")})
        implicit = None if groups else _implicit_group(item)
        if implicit:
            groups = [implicit]
        if groups and not _has_group_suffix(item.nodeid):
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")  # type: ignore[attr-defined]


# Session fixtures that start processes or servers which work while they idle (health polls, Celery beat,
# a browser): torn down as soon as a test is followed by one that does not use them, not at the end of
# the session. Each still starts once: in one process it stops after the last test of the run that uses
# it; under xdist, once its group's tests are done (a group reaches a worker whole: ``SHARED_FIXTURES``
# and the marks put each fixture's users in one), and a later user would start it again.
STOPPED_AFTER_LAST_USER = ("platform", "gateway", "engine_url", "files_gateway", "dashboard",
                           "dashboard_engine", "browser")


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the ``STOPPED_AFTER_LAST_USER`` fixtures ``item`` used and ``nextitem`` does not. An idle
    e2e platform alone (gateway, Celery worker and beat at the tests' short intervals, a two-rank engine)
    used about a fifth of a core for the rest of the run."""
    if nextitem is None:  # the session's end stops everything anyway
        return
    if "PYTEST_XDIST_WORKER" in os.environ:
        # What item used was set up in this process (and may be set up again later, after a stop).
        started = item.session.stash.setdefault(_STARTED, set())
        started.update(_server_fixtures(item))
        # A group's tests reach a worker together, but not all of them use each of its fixtures (the
        # gateway group's tests of the admin API use no engine): at the group's end, stop every one
        # still up that the next test does not use.
        group = _group(item)
        if group is not None and _group(nextitem) == group:
            return
        later: dict[Any, str] = {}
        candidates = started
    else:
        later = _last_users(item.session)
        candidates = _server_fixtures(item)
    for fixturedef in candidates - _server_fixtures(nextitem):
        if fixturedef.cached_result is not None and later.get(fixturedef) in (None, item.nodeid):
            fixturedef.finish(item._request)  # type: ignore[attr-defined]  # dependents first, as pytest does


_STARTED = pytest.StashKey[set[Any]]()


def _group(item: pytest.Item) -> str | None:
    """The xdist group in ``item``'s node id (``...@group``), if any."""
    return item.nodeid.rpartition("@")[2] if _has_group_suffix(item.nodeid) else None


def _server_fixtures(item: pytest.Item) -> set[Any]:
    """The ``STOPPED_AFTER_LAST_USER`` fixtures ``item`` uses, as the definitions it gets (a module may
    define a fixture of the same name: another fixture)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set()
    return {info.name2fixturedefs[name][-1] for name in STOPPED_AFTER_LAST_USER
            if name in info.names_closure and info.name2fixturedefs.get(name)}


_LAST_USERS = pytest.StashKey[dict[Any, str]]()


def _last_users(session: pytest.Session) -> dict[Any, str]:
    """The node id of the last test in this process to use each ``STOPPED_AFTER_LAST_USER`` fixture. An
    xdist worker does not know its later tests (the scheduler hands them out as it goes); its groups
    keep each fixture's tests contiguous instead."""
    if _LAST_USERS not in session.stash:
        session.stash[_LAST_USERS] = {fixturedef: item.nodeid for item in session.items
                                      for fixturedef in _server_fixtures(item)}
    return session.stash[_LAST_USERS]


def worker_id() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


# --------------------------------------------------------------------------- shared servers


@dataclass(frozen=True)
class SharedServers:
    postgres: LocalPostgres
    redis: LocalRedis

    def create_migrated_database(self, name: str) -> str:
        """Database ``name``, recreated empty and migrated to head; returns its URL."""
        from tollgate import schema

        self.postgres.create_database(name, recreate=True)
        url = self.postgres.url(name)
        schema.upgrade(url)
        return url

    @contextmanager
    def migrated_database(self, name: str) -> Iterator[str]:
        """``create_migrated_database(name)``, dropped when the block exits normally."""
        yield self.create_migrated_database(name)
        self.postgres.drop_database(name)


class _ServerPool:
    """Coordinates one Postgres + Redis pair between the processes of a pytest session.

    ``state.json`` (guarded by ``lock``) holds the servers' ports, passwords and pids, the owner's pid
    and the pids of the processes using them.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.state_path = directory / "state.json"
        self.me = os.getpid()
        self.procs: tuple[Any, Any] | None = None  # (postgres, redis) Popen objects when we own them
        self.servers: SharedServers | None = None

    @contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        lock_path = self.directory / "lock"
        while True:
            self.directory.mkdir(mode=0o711, exist_ok=True)
            lock = open(lock_path, "a+")
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:  # the owner may have removed the directory while we waited: lock the new file
                if os.stat(lock_path).st_ino == os.fstat(lock.fileno()).st_ino:
                    break
            except FileNotFoundError:
                pass
            lock.close()
        try:
            state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
            yield state
            if state:
                tmp = self.state_path.with_suffix(".tmp")
                tmp.write_text(json.dumps(state))
                tmp.replace(self.state_path)
            else:
                shutil.rmtree(self.directory, ignore_errors=True)
        finally:
            lock.close()

    def acquire(self) -> SharedServers:
        if self.servers is not None:
            return self.servers
        binaries = find_server_binaries(Settings())
        with self._locked() as state:
            alive = state and pid_alive(state["postgres_pid"]) and pid_alive(state["redis_pid"])
            postgres = LocalPostgres(self.directory / "postgres", binaries.postgres_bin_dir,
                                     port=state["postgres_port"] if alive else free_port(),
                                     password=state["postgres_password"] if alive else secrets.token_hex(16),
                                     durable=False)
            redis = LocalRedis(self.directory / "redis", binaries.redis_server,
                               port=state["redis_port"] if alive else free_port(),
                               password=state["redis_password"] if alive else secrets.token_hex(16),
                               databases=REDIS_DATABASES, durable=False)
            if not alive:
                self._start(postgres, redis)
                state.clear()
                state.update(postgres_port=postgres.port, postgres_password=postgres.password,
                             postgres_pid=self.procs[0].pid, redis_port=redis.port,
                             redis_password=redis.password, redis_pid=self.procs[1].pid,
                             owner=self.me, users=[])
            state["users"] = sorted(set(state["users"]) | {self.me})
        self.servers = SharedServers(postgres, redis)
        return self.servers

    def _start(self, postgres: LocalPostgres, redis: LocalRedis) -> None:
        postgres.prepare()
        redis.prepare()
        pg = spawn(postgres.argv(), log_path=postgres.log_path, user=postgres.user, cwd=postgres.root,
                   parent_death_signal=POSTGRES_STOP_SIGNAL)
        rd = spawn(redis.argv(), log_path=redis.log_path, parent_death_signal=REDIS_STOP_SIGNAL)
        self.procs = (pg, rd)
        try:
            postgres.wait_ready(pg, SERVER_START_TIMEOUT_S)
            redis.wait_ready(rd, SERVER_START_TIMEOUT_S)
        except Exception:
            stop(rd, sig=REDIS_STOP_SIGNAL, timeout=5)
            stop(pg, sig=POSTGRES_STOP_SIGNAL, timeout=5)
            raise

    def release(self) -> None:
        if self.servers is None:
            return
        with self._locked() as state:
            state["users"] = [pid for pid in state.get("users", []) if pid != self.me]
            owner = state.get("owner") == self.me
        if owner:  # the servers die with us: wait for the other users to finish, then stop them
            # No deadline: the other processes run their own tests (each bounded by its timeouts), and a
            # process that dies leaves the list by itself (its pid is no longer alive).
            wait_until(self._stop_when_unused, "the other pytest processes to finish with the servers",
                       timeout_s=math.inf, interval_s=0.2)

    def _stop_when_unused(self) -> bool:
        """Stop the servers (and remove the directory) if no other process uses them; False if one does."""
        with self._locked() as state:
            if any(pid_alive(pid) for pid in state["users"]):
                return False
            pg, rd = self.procs or (None, None)
            for proc, sig in ((rd, REDIS_STOP_SIGNAL), (pg, POSTGRES_STOP_SIGNAL)):
                if proc is not None:
                    stop(proc, sig=sig, timeout=10)
            state.clear()  # removes the directory, under the lock
            return True


def _stop_leftover(state_path: Path) -> None:
    """Stop servers a crashed earlier session left in the same directory (owner gone)."""
    if not state_path.exists():
        return
    state = json.loads(state_path.read_text() or "{}")
    if state and not pid_alive(state.get("owner", 0)):
        for key, sig in (("redis_pid", REDIS_STOP_SIGNAL), ("postgres_pid", POSTGRES_STOP_SIGNAL)):
            if pid_alive(state.get(key, 0)):
                stop_pid(state[key], sig=sig, timeout=10)
        state_path.unlink()


@pytest.fixture(scope="session")
def _server_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_ServerPool]:
    # Workers of one xdist session share the parent of their basetemps; derive a short directory
    # outside pytest's 0700 tree so the postgres user can reach it.
    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent
    digest = hashlib.sha1(str(shared).encode()).hexdigest()[:12]
    pool = _ServerPool(Path(tempfile.gettempdir()) / f"tollgate-test-{digest}")
    _stop_leftover(pool.state_path)
    yield pool
    pool.release()


@pytest.fixture(scope="session")
def shared_servers(_server_pool: _ServerPool) -> SharedServers:
    return _server_pool.acquire()


@pytest.fixture(scope="session")
def database_url(shared_servers: SharedServers) -> str:
    return shared_servers.create_migrated_database(f"tollgate_test_{worker_id()}")


@pytest.fixture(scope="session")
def redis_url(shared_servers: SharedServers) -> str:
    wid = worker_id()
    index = 0 if wid == "main" else int(wid.removeprefix("gw")) + 1
    if index >= REDIS_DATABASES:
        raise RuntimeError(f"too many xdist workers for {REDIS_DATABASES} Redis databases")
    return shared_servers.redis.url(index)


# --------------------------------------------------------------------------- settings


@pytest.fixture(autouse=True)
def _data_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """``TOLLGATE_DATA_DIR`` of the test's own (and of the processes it starts): what one test's apps leave
    there is not another's. A gateway killed in an outage test leaves its spooled usage, which any later
    gateway would adopt and append to its own Redis: another test's ledger."""
    monkeypatch.setenv("TOLLGATE_DATA_DIR", str(tmp_path_factory.mktemp("data")))


def _settings_env(request: pytest.FixtureRequest) -> dict[str, str]:
    env = dict(TEST_ENV)
    if "TOLLGATE_DATA_DIR" in os.environ:  # _data_dir's: kept by the settings fixtures
        env["TOLLGATE_DATA_DIR"] = os.environ["TOLLGATE_DATA_DIR"]
    for marker in reversed(list(request.node.iter_markers("settings"))):
        for field, value in marker.kwargs.items():
            if field not in Settings.model_fields:
                raise ValueError(f"@pytest.mark.settings: unknown Settings field {field!r}")
            env[f"TOLLGATE_{field.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return env


def _install_settings(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Settings:
    for name in list(os.environ):
        if name.startswith("TOLLGATE_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    return get_settings()


@pytest.fixture
def settings(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:
    yield _install_settings(monkeypatch, _settings_env(request))
    get_settings.cache_clear()


@pytest.fixture
def service_settings(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, database_url: str,
                     redis_url: str) -> Iterator[Settings]:
    env = {"TOLLGATE_DATABASE_URL": database_url, "TOLLGATE_REDIS_URL": redis_url, **_settings_env(request)}
    yield _install_settings(monkeypatch, env)
    get_settings.cache_clear()


# --------------------------------------------------------------------------- Postgres


@pytest.fixture(scope="session")
async def db(database_url: str) -> AsyncIterator[Database]:
    database = Database(database_url, pool_size=5)
    yield database
    await database.dispose()


@pytest.fixture
async def _db_connection(db: Database) -> AsyncIterator[Any]:
    async with db.engine.connect() as conn:
        transaction = await conn.begin()
        try:
            yield conn
        finally:
            await transaction.rollback()


@pytest.fixture
def db_sessionmaker(_db_connection: Any) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(bind=_db_connection, expire_on_commit=False,
                              join_transaction_mode="create_savepoint")


@pytest.fixture
def unit_of_work(
    db_sessionmaker: async_sessionmaker[AsyncSession],
) -> Callable[[], AbstractAsyncContextManager[AsyncSession]]:
    return partial(tollgate.db.unit_of_work, db_sessionmaker)


@pytest.fixture
async def db_session(db_sessionmaker: async_sessionmaker[AsyncSession]) -> AsyncIterator[AsyncSession]:
    async with db_sessionmaker() as session:
        yield session


@pytest.fixture
def new_database(shared_servers: SharedServers) -> Iterator[str]:
    with shared_servers.migrated_database(f"tollgate_test_{worker_id()}_{uuid.uuid4().hex[:8]}") as url:
        yield url


# --------------------------------------------------------------------------- Redis


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[Any]:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    await client.flushdb()
    yield client
    await client.aclose()


class PrivateRedis:
    """A Redis server owned by one test (which may stop it)."""

    def __init__(self, root: Path) -> None:
        binaries = find_server_binaries(Settings())
        self.server = LocalRedis(root, binaries.redis_server, port=free_port(), password=secrets.token_hex(8),
                                 durable=False)
        self.server.prepare()
        self.start()

    def start(self) -> None:
        """Start (again: same port, password and append-only files)."""
        self.proc = spawn(self.server.argv(), log_path=self.server.log_path,
                          parent_death_signal=signal.SIGTERM)
        self.server.wait_ready(self.proc, SERVER_START_TIMEOUT_S)

    @property
    def url(self) -> str:
        return self.server.url(0)

    def stop(self, sig: int = REDIS_STOP_SIGNAL) -> None:
        stop(self.proc, sig=sig, timeout=10)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path / "private-redis")
    yield server
    server.stop()
