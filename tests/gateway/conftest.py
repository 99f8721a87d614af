"""Fixtures for the OpenAI API tests: a real engine replica, a real gateway, real Postgres and Redis.

Started once per test session by the worker that runs their tests (one xdist group: ``tests/conftest.py``)
and shared:
- ``tiny_model_dir``: a random-weight llama checkpoint (``engine.tiny``).
- ``engine_url``: ``tollgate engine --model <tiny>`` as a subprocess on a free port (CPU), with a host
  and a disk tier under its prefix cache (what cache lifetimes pin and retain in).
- ``api_database_url``: a database of its own (the gateway commits; other tests roll back), migrated.
- ``gateway``: the gateway app (``gateway.app.create_app``) served by uvicorn on a free port inside the
  test loop, configured with one model ``tiny`` on the engine, plus one dead replica URL in the pool so
  every test also exercises taking a replica out. ``gateway.url`` is its base URL.
- ``tenant_key``: a committed tenant with generous limits and an API key for it (new per test).
Usage records land in the Redis stream ``tollgate:usage`` of the worker's Redis database.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from tests.factories import create_api_key, create_price, create_tenant
from tests.polling import DEFAULT_TIMEOUT_S, eventually, wait_until
from tollgate.db import Database
from tollgate.local_services import free_port
from tollgate.settings import ModelConfig, PoolConfig, Settings, default_tiers

MODEL = "tiny"
ENGINE_START_TIMEOUT_S = 120.0


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny import create_tiny_checkpoint

    return create_tiny_checkpoint(tmp_path_factory.mktemp("gateway_tiny"), arch="llama", seed=0)


@contextlib.contextmanager
def run_engine(model_dir: Path, log: Path, port: int | None = None,
               options: tuple[str, ...] = ("--num-kv-blocks", "512"), *, host: str = "127.0.0.1",
               env: dict[str, str] | None = None,
               timeout_s: float = ENGINE_START_TIMEOUT_S) -> Iterator[tuple[str, subprocess.Popen]]:
    """``tollgate engine`` as a subprocess (on ``host``:``port``, else a free port), once it answers
    ``/health`` (within ``timeout_s``); ``env``: variables to add (e.g. ``TOLLGATE_INTERNAL_TOKEN``)."""
    port = port or free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from tollgate.cli import main; main()", "engine", "--model",
             str(model_dir), "--host", host, "--port", str(port), "--max-num-seqs", "16", *options],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    url = f"http://{host}:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/health", timeout=5.0).status_code == 200
        return False

    try:
        try:
            wait_until(healthy, "the engine to answer /health", timeout_s=timeout_s,
                       interval_s=0.1)
        except AssertionError as exc:
            raise RuntimeError(f"engine did not start ({exc}):\n{log.read_text()[-3000:]}") from None
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tiered(kv_dir: Path) -> tuple[str, ...]:
    """``run_engine`` options of a replica with a host and a disk tier under its prefix cache (in
    ``kv_dir``), as ``tollgate up`` starts its own engine."""
    return ("--num-kv-blocks", "512", "--host-kv-gb", "0.01", "--disk-kv-gb", "0.02",
            "--kv-disk-dir", str(kv_dir))


@pytest.fixture(scope="session")
def engine_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with run_engine(tiny_model_dir, tmp_path_factory.mktemp("engine_log") / "engine.log",
                    options=tiered(tmp_path_factory.mktemp("engine_kv"))) as (url, _):
        yield url


@pytest.fixture(scope="session")
def api_database_url(shared_servers: Any) -> Iterator[str]:
    name = f"tollgate_api_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}_{uuid.uuid4().hex[:6]}"
    with shared_servers.migrated_database(name) as url:
        yield url


@dataclass
class GatewayUnderTest:
    url: str
    app: Any
    settings: Settings
    db: Database

    @property
    def runtime(self) -> Any:
        return self.app.state.gateway


def gateway_settings(replicas: list[str], model_dir: Path, database_url: str, redis_url: str) -> Settings:
    return Settings(
        environment="test", database_url=database_url, redis_url=redis_url,
        models=[ModelConfig(name=MODEL, path=str(model_dir))],
        pools={"interactive": PoolConfig(replicas=replicas)},
        health_poll_interval_s=0.2, health_check_timeout_s=1.0, key_cache_ttl_s=5.0,
        max_request_body_bytes=64 * 1024, default_max_tokens_reservation=64,
        # A CPU engine is slow: SLOs loose enough that overload shedding never fires here.
        tiers={name: tier.model_copy(update={"ttft_slo_ms": 600_000, "tpot_slo_ms": 60_000})
               for name, tier in default_tiers().items()},
    )


@contextlib.asynccontextmanager
async def run_gateway(settings: Settings, resolver: Any = None,
                      environ: Mapping[str, str] | None = None) -> AsyncIterator[GatewayUnderTest]:
    """The gateway app under uvicorn on a free port, in the running event loop; ``resolver`` resolves
    the pools' DNS names (``gateway.replicas.Resolver``) instead of the system's; ``environ``: variables
    set while the app is made and starts (the ``OTEL_*`` ones are read then), and unset once it serves."""
    from tollgate.gateway_app import create_app

    db = Database(settings.database_url or "", pool_size=2)
    env = pytest.MonkeyPatch()
    try:
        for name, value in (environ or {}).items():
            env.setenv(name, value)
        app = create_app(settings)
        if resolver is not None:
            app.state.replica_resolver = resolver
        port = free_port()
        # Drained as `tollgate gateway` drains (settings.drain_timeout_s): a request still running at the
        # end of the tests is cut, not waited for forever.
        grace = max(1, round(settings.drain_timeout_s))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                               lifespan="on", timeout_graceful_shutdown=grace))
        task = asyncio.create_task(server.serve())

        def started() -> bool:
            if task.done():
                task.result()  # serve() failed (e.g. the lifespan raised): its error, not a timeout
                raise RuntimeError("uvicorn stopped before it started serving")
            return server.started

        await eventually(started, "the gateway's uvicorn to start")
    finally:
        env.undo()
    try:
        yield GatewayUnderTest(f"http://127.0.0.1:{port}", app, settings, db)
    finally:
        server.should_exit = True
        await task
        await db.dispose()


@pytest.fixture(scope="session")
async def model_price(api_database_url: str) -> None:
    """The model's price in the session's API database (a gateway serves only priced models)."""
    db = Database(api_database_url, pool_size=1)
    async with db.session() as session:
        await create_price(session, model=MODEL)
    await db.dispose()


@pytest.fixture(scope="session")
async def gateway(engine_url: str, tiny_model_dir: Path, api_database_url: str, redis_url: str,
                  model_price: None) -> AsyncIterator[GatewayUnderTest]:
    # A dead replica next to the live one: the router must take it out and never send work there.
    dead_replica = f"http://127.0.0.1:{free_port()}"
    settings = gateway_settings([engine_url, dead_replica], tiny_model_dir, api_database_url, redis_url)
    async with run_gateway(settings) as running:
        yield running


@dataclass
class TenantKey:
    tenant_id: int
    api_key_id: int
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


async def make_tenant_key(gateway: GatewayUnderTest, **tenant_columns: Any) -> TenantKey:
    """A new tenant and key. Its admission counters and spend are cleared in Redis: the worker's Redis
    database is shared with tests on other Postgres databases, whose tenants may have had this id."""
    from billing.spend import spend_key
    from gateway.admission.controller import admission_keys

    key_columns = {k: tenant_columns.pop(k) for k in ("allowed_models", "revoked_at") if k in tenant_columns}
    async with gateway.db.session() as session:
        tenant = await create_tenant(session, **tenant_columns)
        key, full_key = await create_api_key(session, tenant, settings=gateway.settings, **key_columns)
    await gateway.runtime.redis.delete(*admission_keys(tenant.id), spend_key(tenant.id))
    return TenantKey(tenant.id, key.id, full_key)


@pytest.fixture
async def tenant_key(gateway: GatewayUnderTest) -> TenantKey:
    return await make_tenant_key(gateway)


@pytest.fixture
async def client(gateway: GatewayUnderTest, tenant_key: TenantKey) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"{gateway.url}/v1", headers=tenant_key.headers,
                                 timeout=60.0) as c:
        yield c


async def usage_records(redis_client: Any, request_id: str) -> list[dict[str, Any]]:
    """The outbox entries of one request (normally exactly one)."""
    from billing.outbox import RECORD_FIELD, USAGE_STREAM, UsageRecord

    entries = await redis_client.xrange(USAGE_STREAM)
    records = [UsageRecord.from_json(fields[RECORD_FIELD]) for _, fields in entries]
    return [r.row() for r in records if r.request_id == request_id]


async def wait_for_usage(redis_url: str, request_id: str,
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> list[dict[str, Any]]:
    """Outbox entries of ``request_id``, once at least one exists (the gateway appends after the
    response, e.g. after a disconnect); ``AssertionError`` if none comes (``timeout_s`` bounds a hang)."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    try:
        return await eventually(lambda: usage_records(client, request_id),
                                f"the usage record of {request_id}", timeout_s=timeout_s, interval_s=0.05)
    finally:
        await client.aclose()


# The files gateway (the files and batches tests; defined here, once: a module importing a session fixture
# from another gets a definition, and a set-up, of its own). No engine: files and batch bookkeeping need
# none.
MAX_FILE_BYTES = 4096
# Below MAX_FILE_BYTES, so an upload can be larger than any API call may be.
MAX_API_BODY_BYTES = 2048


@pytest.fixture(scope="session")
async def files_gateway(shared_servers: Any, redis_url: str,
                        tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GatewayUnderTest]:
    with shared_servers.migrated_database(f"tollgate_files_{uuid.uuid4().hex[:8]}") as url:
        settings = Settings(environment="test", database_url=url, redis_url=redis_url,
                            models=[ModelConfig(name="tiny")],
                            file_storage_dir=tmp_path_factory.mktemp("files"), files_max_bytes=MAX_FILE_BYTES,
                            max_request_body_bytes=MAX_API_BODY_BYTES, health_poll_interval_s=0.5,
                            key_cache_ttl_s=0.5)
        async with run_gateway(settings) as gateway:
            yield gateway
