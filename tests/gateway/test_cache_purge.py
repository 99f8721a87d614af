"""Purging a tenant's prompt cache through the admin API (``POST /admin/v1/tenants/{id}/purge-cache``) on
the session's gateway: a real engine with host and disk tiers, and a dead replica in the same pool. What
the engine holds is read from its ``/kv/events`` snapshot with each tenant's salted block hashes; what a
tenant notices is its next request's ``cached_tokens``. And the service alone: a replica that never
answers is reported after the timeout, next to the others' outcomes."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from gateway.admin import service
from tests.factories import create_tenant
from tests.gateway.conftest import GatewayUnderTest, TenantKey, make_tenant_key
from tests.gateway.test_admin_api import assert_error
from tests.gateway.test_engine_client import scripted
from tests.gateway.test_prompt_cache_lifetimes import SYSTEM, chat, holdings, prompt_hashes
from tollgate.local_services import free_port
from tollgate.models import AuditLog
from tollgate.settings import PoolConfig, Settings

pytestmark = pytest.mark.slow


ADMIN_EMAIL = f"purger-{uuid.uuid4().hex[:6]}@example.com"


@pytest.fixture(scope="module")
async def admin_token(gateway: GatewayUnderTest) -> str:
    async with gateway.db.session() as session:
        _, token = await service.create_admin(session, ADMIN_EMAIL, settings=gateway.settings, actor="test")
    return token


@pytest.fixture
async def admin(gateway: GatewayUnderTest, admin_token: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"{gateway.url}/admin/v1", timeout=60.0,
                                 headers={"Authorization": f"Bearer {admin_token}"}) as c:
        yield c


def cached_tokens(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_purge_drops_the_tenants_blocks_and_names_the_replica_it_missed(
        gateway: GatewayUnderTest, engine_url: str, client: httpx.AsyncClient, tenant_key: TenantKey,
        admin: httpx.AsyncClient) -> None:
    other = await make_tenant_key(gateway)
    body = chat([{"type": "text", "text": SYSTEM}], "Which rule comes first?")
    async with httpx.AsyncClient(base_url=f"{gateway.url}/v1", headers=other.headers,
                                 timeout=60.0) as other_client:
        cached_tokens(await client.post("/chat/completions", json=body))
        cached_tokens(await other_client.post("/chat/completions", json=body))
        mine, theirs = prompt_hashes(gateway, tenant_key, body), prompt_hashes(gateway, other, body)
        held = await holdings(engine_url)
        assert mine and all(d in held for d in mine) and all(d in held for d in theirs)

        r = await admin.post(f"/tenants/{tenant_key.tenant_id}/purge-cache", json={"note": "erasure #42"})
        assert r.status_code == 200, r.text
        report = r.json()
        dead = next(url for url in gateway.settings.pools["interactive"].replicas if url != engine_url)
        by_url = {row["url"]: row for row in report["replicas"]}
        assert set(report) == {"tenant_id", "replicas", "purged_blocks"}
        assert report["tenant_id"] == tenant_key.tenant_id and set(by_url) == {engine_url, dead}
        assert by_url[engine_url]["error"] is None and by_url[engine_url]["purged_blocks"] >= len(mine)
        assert by_url[dead]["purged_blocks"] is None and "Cannot connect" in by_url[dead]["error"]
        assert report["purged_blocks"] == by_url[engine_url]["purged_blocks"]

        held = await holdings(engine_url)
        assert not any(d in held for d in mine)
        assert all(d in held for d in theirs)  # another tenant's blocks are untouched
        assert cached_tokens(await client.post("/chat/completions", json=body)) == 0
        assert cached_tokens(await other_client.post("/chat/completions", json=body)) > 0

    audit = await admin.get("/audit", params={"tenant_id": tenant_key.tenant_id,
                                              "action": "tenant.purge_cache"})
    [entry] = audit.json()["data"]
    assert entry["actor"] == f"admin:{ADMIN_EMAIL}"
    assert entry["details"]["purged_blocks"] == report["purged_blocks"]
    assert entry["details"]["replicas"] == {engine_url: report["purged_blocks"]}
    assert set(entry["details"]["failed"]) == {dead} and entry["details"]["note"] == "erasure #42"


async def test_purging_an_unknown_tenant_is_404_in_the_admin_error_body(admin: httpx.AsyncClient) -> None:
    error = assert_error(await admin.post("/tenants/999999999/purge-cache"), 404)
    assert error["code"] == "not_found" and "999999999" in error["message"]
    assert_error(await admin.post("/tenants/1/purge-cache", json={"reason": "x"}), 400)


async def test_a_replica_that_never_answers_is_reported_after_the_timeout(db_session: Any,
                                                                         settings: Settings) -> None:
    tenant = await create_tenant(db_session)
    purged = asyncio.Event()

    async def hang(line: bytes, body: bytes, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter) -> bool:
        await purged.wait()  # the replica takes the request and says nothing until the purge is over
        return False

    async with scripted(hang) as (hanging, _):
        dead = f"http://127.0.0.1:{free_port()}"
        configured = settings.model_copy(update={"pools": {"interactive": PoolConfig(replicas=[hanging]),
                                                           "batch": PoolConfig(replicas=[dead + "/"])}})
        purge = await service.purge_tenant_cache(db_session, tenant.id, settings=configured, actor="test",
                                                 timeout_s=0.2)
        purged.set()
    assert [(r.url, r.purged_blocks) for r in purge.replicas] == [(hanging, None), (dead, None)]
    assert purge.replicas[0].error == "no answer within 0.2 s"
    assert "Cannot connect" in (purge.replicas[1].error or "") and purge.purged_blocks == 0
    entry = (await db_session.scalars(select(AuditLog).where(AuditLog.tenant_id == tenant.id))).one()
    assert entry.action == "tenant.purge_cache" and set(entry.details["failed"]) == {hanging, dead}
