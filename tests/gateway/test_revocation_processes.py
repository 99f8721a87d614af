"""Key revocation reaches every gateway process, with real processes and servers.

- Three ``tollgate gateway`` processes (each its own key cache) share Postgres and Redis; a key used on
  each is revoked through the admin API of one of them, and every process refuses it. The key cache
  TTL is an hour and the test waits at most ``REFUSAL_TIMEOUT_S`` (a bound on a hang, not a speed), so
  a refusal can only come from the ``tollgate:invalidate`` message; another key of the same tenant
  keeps working (the message drops only what it names).
- A revocation published while a gateway's subscription is down is lost (pub/sub does not queue). The
  gateway is frozen (SIGSTOP), its subscription killed on the Redis server (``CLIENT KILL TYPE pubsub``),
  the key revoked (nobody subscribed: the message goes nowhere), then the gateway resumes: its Redis
  client reconnects and resubscribes, and the cache must be flushed then, so the key is refused long
  before the TTL. A private Redis, so the kill touches no other test's gateways.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from pydantic import SecretStr

from gateway.admin import service
from gateway.admin.uow import admin_unit_of_work
from tests.factories import create_api_key, create_tenant
from tests.gateway.gateway_processes import GatewayProcess, gateway_env, gateway_process
from tests.polling import eventually
from tollgate.db import Database
from tollgate.local_services import free_port
from tollgate.redis import create_redis
from tollgate.settings import DEV_SECRET, Settings

pytestmark = pytest.mark.slow

REFUSAL_TIMEOUT_S = 120.0  # a hang guard: how fast a revocation arrives is not this test's business
KEY_CACHE_TTL_S = 3600  # far beyond the guard: only an invalidation or a flush explains a refusal
GATEWAYS = 3


def _settings(database_url: str, redis_url: str) -> Settings:
    # The gateways run with TOLLGATE_ENVIRONMENT=test and no secret set: the development secret.
    return Settings(environment="test", database_url=database_url, redis_url=redis_url,
                    key_hash_secret=SecretStr(DEV_SECRET))


async def _seed(settings: Settings) -> dict[str, Any]:
    db = Database(settings.database_url or "", pool_size=1)
    try:
        async with db.session() as session:
            tenant = await create_tenant(session)
            key, secret = await create_api_key(session, tenant, settings=settings)
            _, other_secret = await create_api_key(session, tenant, settings=settings, name="kept")
            _, admin_token = await service.create_admin(session, f"ops-{uuid.uuid4().hex[:6]}@example.com",
                                                        settings=settings, actor="test")
        return {"tenant_id": tenant.id, "key_id": key.id, "key": secret, "other_key": other_secret,
                "admin_token": admin_token}
    finally:
        await db.dispose()


@contextmanager
def _gateways(env: dict[str, str], tmp_path: Path, count: int) -> Iterator[list[GatewayProcess]]:
    with ExitStack() as stack:
        yield [stack.enter_context(gateway_process(env, tmp_path / f"gateway-{i}.log")) for i in range(count)]


def _env(database_url: str, redis_url: str, tiny_model_dir: Path) -> dict[str, str]:
    # No engine: authentication is all these tests exercise (GET /v1/models needs a valid key only).
    return gateway_env(database_url=database_url, redis_url=redis_url, tokenizer_dir=tiny_model_dir,
                       replicas=[f"http://127.0.0.1:{free_port()}"], key_cache_ttl_s=str(KEY_CACHE_TTL_S))


async def _status(client: httpx.AsyncClient, url: str, key: str) -> int:
    return (await client.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})).status_code


async def _refused(client: httpx.AsyncClient, url: str, key: str) -> bool:
    status = await _status(client, url, key)
    assert status in (200, 401), status
    return status == 401


async def test_revocation_reaches_every_gateway_process(
        new_database: str, redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    seed = await _seed(_settings(new_database, redis_url))
    with _gateways(_env(new_database, redis_url, tiny_model_dir), tmp_path, GATEWAYS) as gateways:
        async with httpx.AsyncClient(timeout=10.0) as client:
            # The key is in every process's cache (and keeps being served from it).
            for gw in gateways:
                assert [await _status(client, gw.url, seed["key"]) for _ in range(3)] == [200] * 3
            revoked = await client.post(
                f"{gateways[0].url}/admin/v1/tenants/{seed['tenant_id']}/keys/{seed['key_id']}/revoke",
                headers={"Authorization": f"Bearer {seed['admin_token']}"})
            assert revoked.status_code == 200, revoked.text
            await asyncio.gather(*(
                eventually(lambda gw=gw: _refused(client, gw.url, seed["key"]),
                           f"{gw.url} to refuse the revoked key", timeout_s=REFUSAL_TIMEOUT_S)
                for gw in gateways))
            for gw in gateways:
                assert await _status(client, gw.url, seed["key"]) == 401
                assert await _status(client, gw.url, seed["other_key"]) == 200


def _pubsub_clients(client: redis.Redis) -> int:
    return len(client.client_list(_type="pubsub"))


async def test_cache_is_flushed_when_the_subscription_reconnects(
        new_database: str, private_redis: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = _settings(new_database, private_redis.url)
    seed = await _seed(settings)
    server = redis.Redis.from_url(private_redis.url)
    db = Database(new_database, pool_size=1)
    publisher = create_redis(settings)
    try:
        env = _env(new_database, private_redis.url, tiny_model_dir)
        with gateway_process(env, tmp_path / "gw.log") as gw:
            async with httpx.AsyncClient(timeout=10.0) as client:
                assert await _status(client, gw.url, seed["key"]) == 200  # cached for a minute
                await eventually(lambda: _pubsub_clients(server) == 1, "the gateway subscribed")
                os.killpg(gw.proc.pid, signal.SIGSTOP)  # the gateway and its workers
                try:
                    assert server.client_kill_filter(_type="pubsub") == 1
                    assert server.pubsub_numsub("tollgate:invalidate") == [(b"tollgate:invalidate", 0)]
                    # Revoked (committed and published) while nobody listens: the message is lost.
                    async with admin_unit_of_work(db, publisher) as session:
                        await service.revoke_key(session, seed["tenant_id"], seed["key_id"],
                                                 settings=settings, actor="test")
                finally:
                    os.killpg(gw.proc.pid, signal.SIGCONT)
                # redis-py reconnects (with its backoff), resubscribes, and the cache is flushed.
                await eventually(lambda: _refused(client, gw.url, seed["key"]),
                                 "the revoked key refused after the reconnect", timeout_s=REFUSAL_TIMEOUT_S)
                assert await _status(client, gw.url, seed["other_key"]) == 200
                # Resubscribed: later revocations arrive as messages again.
                await eventually(lambda: _pubsub_clients(server) == 1, "the gateway subscribed")
    finally:
        await publisher.aclose()
        await db.dispose()
        server.close()
