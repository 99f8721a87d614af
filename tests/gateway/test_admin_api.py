"""The admin API (``/admin/v1``) on the whole gateway app, in process (``httpx.ASGITransport``), against
real Postgres and Redis.

The app commits, so the module uses a database of its own (dropped at the end); tests create uniquely
named rows and filter by their ids. The gateway's key cache TTL is a day here, far longer than any wait
of these tests (``tests/polling.py``'s deadlines only bound a hang), so a key or tenant change that the
gateway shows at all can only have come through the Redis invalidation, never through expiry.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest
from sqlalchemy import select, text

from billing.prices import CACHE_TOKEN_FIELDS
from engine.usage import FIELDS
from gateway.admin import service
from gateway.auth import Principal
from gateway.errors import GatewayError
from tests.factories import create_api_key, create_tenant, create_usage_event
from tests.polling import DEFAULT_TIMEOUT_S, eventually
from tollgate.db import Database
from tollgate.gateway_app import create_app
from tollgate.models import Tenant
from tollgate.settings import Settings

# Longer than any wait here by far: nothing a test sees can come from a cache entry's expiry.
KEY_CACHE_TTL_S = 24 * 3600.0


@dataclass
class AdminApi:
    app: Any
    settings: Settings
    db: Database
    token: str
    email: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def client(self, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://gateway",
                                 headers=self.headers if headers is None else headers)


@pytest.fixture(scope="module")
def admin_database_url(shared_servers: Any) -> Any:
    with shared_servers.migrated_database(f"tollgate_admin_{uuid.uuid4().hex[:8]}") as url:
        yield url


@pytest.fixture(scope="module")
async def api(admin_database_url: str, redis_url: str) -> AsyncIterator[AdminApi]:
    settings = Settings(environment="test", database_url=admin_database_url, redis_url=redis_url,
                        key_cache_ttl_s=KEY_CACHE_TTL_S)
    db = Database(admin_database_url, pool_size=2)
    email = f"ops-{uuid.uuid4().hex[:6]}@example.com"
    async with db.session() as session:
        _, token = await service.create_admin(session, email, settings=settings, actor="test")
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        await asyncio.wait_for(app.state.gateway.auth.subscribed.wait(), DEFAULT_TIMEOUT_S)
        yield AdminApi(app, settings, db, token, email)
    await db.dispose()


@pytest.fixture
async def client(api: AdminApi) -> AsyncIterator[httpx.AsyncClient]:
    async with api.client() as c:
        yield c


def unique(stem: str) -> str:
    return f"{stem}-{uuid.uuid4().hex[:8]}"


def assert_error(response: httpx.Response, status: int | tuple[int, ...]) -> dict[str, Any]:
    statuses = (status,) if isinstance(status, int) else status
    assert response.status_code in statuses, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


async def principal(api: AdminApi, key: str) -> Principal:
    return await api.app.state.gateway.auth.authenticate(f"Bearer {key}")


async def create_tenant_api(client: httpx.AsyncClient, **fields: Any) -> dict[str, Any]:
    response = await client.post("/admin/v1/tenants", json={"name": unique("t"), **fields})
    assert response.status_code == 201, response.text
    return response.json()


# ------------------------------------------------------------------------------------------ auth


async def test_admin_token_opens_the_api_and_anything_else_is_401(api: AdminApi) -> None:
    async with api.client() as c:
        assert (await c.get("/admin/v1/tenants")).status_code == 200
    for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": f"Basic {api.token}"},
                    {"Authorization": "Bearer tg-admin-" + "x" * 43},
                    {"Authorization": f"Bearer {api.token[:-1]}"},
                    {"Authorization": "Bearer sk-tg-aaaaaaaaaaaa-" + "A" * 43}):
        async with api.client(headers) as c:
            response = await c.get("/admin/v1/tenants")
        error = assert_error(response, 401)
        assert api.token not in response.text and error["type"] == "invalid_request_error"
        assert response.headers["www-authenticate"].startswith("Bearer")


async def test_a_tenant_api_key_is_403_and_never_opens_the_admin_api(api: AdminApi) -> None:
    async with api.db.session() as session:
        _, key = await create_api_key(session, settings=api.settings)
    async with api.client({"Authorization": f"Bearer {key}"}) as c:
        assert (await c.get("/v1/models")).status_code == 200
        for response in (await c.get("/admin/v1/tenants"),
                         await c.post("/admin/v1/tenants", json={"name": "x"})):
            assert assert_error(response, 403)["code"] == "tenant_key_not_allowed"


async def test_unknown_admin_route_is_a_json_404(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/admin/v1/nothing-here"), 404)


# ------------------------------------------------------------------------------------------ bad input

BAD_REQUESTS: list[tuple[str, str, Any]] = [
    ("POST", "/admin/v1/tenants", {}),
    ("POST", "/admin/v1/tenants", {"name": "ok", "tpm_limit": -1}),
    ("POST", "/admin/v1/tenants", {"name": "ok", "max_concurrency": 2**31}),
    ("POST", "/admin/v1/tenants", {"name": "ok", "rpm_limit": 2**63}),
    ("POST", "/admin/v1/tenants", {"name": "ok", "surprise": 1}),
    ("POST", "/admin/v1/tenants", {"name": "-bad name"}),
    ("POST", "/admin/v1/tenants", {"name": "3"}),  # digits alone would be read as a tenant id
    ("POST", "/admin/v1/tenants", {"name": "ok", "tpm_limit": True}),
    ("POST", "/admin/v1/tenants", {"name": "ok", "monthly_budget_usd": "lots"}),
    ("POST", "/admin/v1/tenants", {"name": "ok", "monthly_budget_usd": "-1"}),
    ("POST", "/admin/v1/tenants", {"name": "ok", "monthly_budget_usd": "0.0000000000001"}),
    ("POST", "/admin/v1/tenants", {"name": "ok", "monthly_budget_usd": 1.0000000000000002}),
    ("POST", "/admin/v1/tenants", {"name": "ok", "monthly_budget_usd": "1e30"}),
    ("POST", "/admin/v1/tenants", {"name": "ok", "monthly_budget_usd": True}),
    ("POST", "/admin/v1/tenants", {"name": "ok", "tier": "gold"}),
    ("POST", "/admin/v1/tenants", [1, 2]),
    ("POST", "/admin/v1/tenants", "not json {"),
    ("GET", "/admin/v1/tenants/abc", None),
    ("GET", f"/admin/v1/tenants/{2**70}", None),
    ("GET", "/admin/v1/tenants?limit=0", None),
    ("GET", "/admin/v1/tenants?status=deleted", None),
    ("POST", "/admin/v1/prices", {"model": "m", "input_usd_per_mtok": "3"}),
    ("POST", "/admin/v1/prices", {"model": "m", "input_usd_per_mtok": "0.0000001", "output_usd_per_mtok": 1}),
    ("POST", "/admin/v1/prices", {"model": "m", "input_usd_per_mtok": 1, "output_usd_per_mtok": 1,
                                  "effective_from": "2030-01-01T00:00:00"}),
    ("POST", "/admin/v1/prices", {"model": "m", "input_usd_per_mtok": 1, "output_usd_per_mtok": 1,
                                  "effective_from": "2001-01-01T00:00:00Z"}),
    ("POST", "/admin/v1/prices", {"model": "m", "input_usd_per_mtok": 1, "output_usd_per_mtok": 1,
                                  "effective_from": "9999-12-31T23:59:59-05:00"}),
    ("GET", "/admin/v1/usage?group_by=colour", None),
    ("GET", "/admin/v1/usage?granularity=week", None),
    ("GET", "/admin/v1/usage?start=2030-01-02&end=2030-01-01", None),
    ("GET", "/admin/v1/usage?start=yesterday", None),
    ("GET", "/admin/v1/audit?before_id=-1", None),
]
# Well-formed but naming nothing: a 404, never the database's overflow (a 500 before).
NOT_FOUND = ["/admin/v1/statements/99999999999999999999?month=2026-11",
             "/admin/v1/statements/99999999999999999999.csv?month=2026-11"]


@pytest.mark.parametrize("path", NOT_FOUND)
async def test_an_id_past_the_columns_range_is_a_404(client: httpx.AsyncClient, path: str) -> None:
    assert_error(await client.get(path), 404)


@pytest.mark.parametrize(("method", "path", "body"), BAD_REQUESTS)
async def test_bad_input_is_a_4xx_json_error_never_a_500(client: httpx.AsyncClient, method: str, path: str,
                                                         body: Any) -> None:
    content = body if isinstance(body, str) else None
    response = await client.request(method, path, json=None if content is not None else body, content=content,
                                    headers={"content-type": "application/json"} if body is not None else {})
    assert_error(response, (400, 422))


async def test_bad_patches_are_400_and_change_nothing(client: httpx.AsyncClient) -> None:
    tenant = await create_tenant_api(client, rpm_limit=10)
    path = f"/admin/v1/tenants/{tenant['id']}"
    for body in ({"rpm_limit": -1}, {"tier": None}, {"tier": "gold"}, {"max_concurrency": "many"},
                 {"name": "renamed"}, {"monthly_budget_usd": "-5"}, {"tpm_limit": True}):
        error = assert_error(await client.patch(path, json=body), 400)
        assert error["type"] == "invalid_request_error"
    assert (await client.get(path)).json() == tenant


async def test_a_stripe_customer_of_another_tenant_is_named_in_the_409(client: httpx.AsyncClient) -> None:
    customer = f"cus_{uuid.uuid4().hex[:12]}"
    await create_tenant_api(client, stripe_customer_id=customer)
    error = assert_error(await client.post("/admin/v1/tenants", json={
        "name": f"t-{uuid.uuid4().hex[:8]}", "stripe_customer_id": customer}), 409)
    assert "Stripe customer" in error["message"] and "already exists" not in error["message"]


async def test_unknown_tenant_and_key_are_404(client: httpx.AsyncClient) -> None:
    missing = 9_000_000_000
    assert_error(await client.get(f"/admin/v1/tenants/{missing}"), 404)
    assert_error(await client.patch(f"/admin/v1/tenants/{missing}", json={"rpm_limit": 1}), 404)
    assert_error(await client.post(f"/admin/v1/tenants/{missing}/keys", json={}), 404)
    assert_error(await client.get(f"/admin/v1/tenants/{missing}/usage"), 404)
    tenant = await create_tenant_api(client)
    assert_error(await client.post(f"/admin/v1/tenants/{tenant['id']}/keys/{missing}/revoke"), 404)


# ------------------------------------------------------------------------------------------ tenants


async def test_create_get_list_and_search_tenants(client: httpx.AsyncClient) -> None:
    stem = unique("Acme_Corp")
    created = await create_tenant_api(client, name=stem, tier="priority", tpm_limit=90_000, rpm_limit=60,
                                      max_concurrency=4, batch_tpd_limit=10**6, monthly_budget_usd="12.50")
    assert created["status"] == "active" and created["suspended_reason"] is None
    assert created["monthly_budget_pico_usd"] == 12_500_000_000_000
    assert created["monthly_budget_usd"] == "12.5"
    assert (await client.get(f"/admin/v1/tenants/{created['id']}")).json() == created
    assert_error(await client.post("/admin/v1/tenants", json={"name": stem}), 409)
    second = await create_tenant_api(client, name=f"{stem}-b", monthly_budget_usd=0.1)
    assert second["monthly_budget_pico_usd"] == 100_000_000_000

    found = (await client.get("/admin/v1/tenants", params={"search": stem.lower()})).json()
    assert [t["id"] for t in found["data"]] == [created["id"], second["id"]] and found["total"] == 2
    page = (await client.get("/admin/v1/tenants", params={"search": stem, "limit": 1, "offset": 1})).json()
    assert [t["id"] for t in page["data"]] == [second["id"]] and page["has_more"] is False
    first = (await client.get("/admin/v1/tenants", params={"search": stem, "limit": 1})).json()
    assert first["has_more"] is True
    by_id = (await client.get("/admin/v1/tenants", params={"search": str(second["id"])})).json()
    assert second["id"] in [t["id"] for t in by_id["data"]]
    # LIKE wildcards in the search term are literal characters.
    assert (await client.get("/admin/v1/tenants", params={"search": "%"})).json()["total"] == 0


async def test_patch_tier_and_limits_reaches_the_gateway_through_the_invalidation(
        api: AdminApi, client: httpx.AsyncClient) -> None:
    tenant = await create_tenant_api(client, rpm_limit=10, tpm_limit=1000)
    key = (await client.post(f"/admin/v1/tenants/{tenant['id']}/keys", json={})).json()["key"]
    before = await principal(api, key)  # now cached for a day: only the invalidation can drop it
    assert (before.tenant.tier, before.tenant.rpm_limit) == ("default", 10)

    response = await client.patch(f"/admin/v1/tenants/{tenant['id']}",
                                  json={"tier": "priority", "rpm_limit": 7, "tpm_limit": None,
                                        "monthly_budget_usd": "100.000000000001"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["tier"], body["rpm_limit"], body["tpm_limit"]) == ("priority", 7, None)
    assert body["monthly_budget_pico_usd"] == 100_000_000_000_001
    assert body["monthly_budget_usd"] == "100.000000000001"
    assert body["max_concurrency"] is None and body["name"] == tenant["name"]

    async def reloaded() -> bool:
        limits = (await principal(api, key)).tenant
        return (limits.tier, limits.rpm_limit, limits.tpm_limit) == ("priority", 7, None)

    await eventually(reloaded, "the gateway to see the new tier and limits")
    unchanged = await client.patch(f"/admin/v1/tenants/{tenant['id']}", json={})
    assert unchanged.status_code == 200 and unchanged.json() == body


async def test_suspend_and_reactivate_an_admin_suspension(api: AdminApi, client: httpx.AsyncClient) -> None:
    tenant = await create_tenant_api(client)
    path = f"/admin/v1/tenants/{tenant['id']}"
    key = (await client.post(f"{path}/keys", json={})).json()["key"]
    assert (await principal(api, key)).tenant.status == "active"

    suspended = await client.post(f"{path}/suspend", json={"note": "abuse report #12"})
    assert (suspended.json()["status"], suspended.json()["suspended_reason"]) == ("suspended", "admin")
    assert (await client.post(f"{path}/suspend")).json()["suspended_reason"] == "admin"  # idempotent

    async def gateway_sees(status: str) -> bool:
        return (await principal(api, key)).tenant.status == status

    await eventually(lambda: gateway_sees("suspended"), "the gateway to see the suspension")
    reactivated = await client.post(f"{path}/reactivate")
    assert (reactivated.json()["status"], reactivated.json()["suspended_reason"]) == ("active", None)
    await eventually(lambda: gateway_sees("active"), "the gateway to see the reactivation")


async def test_a_billing_suspension_is_never_lifted_silently(api: AdminApi,
                                                             client: httpx.AsyncClient) -> None:
    async with api.db.session() as session:
        tenant: Tenant = await create_tenant(session, status="suspended", suspended_reason="billing")
    path = f"/admin/v1/tenants/{tenant.id}"

    error = assert_error(await client.post(f"{path}/reactivate"), 409)
    assert "billing" in error["message"] and "force" in error["message"]
    assert_error(await client.post(f"{path}/reactivate", json={"force": False}), 409)
    assert_error(await client.post(f"{path}/suspend"), 409)  # an admin reason would hide the billing one
    still = (await client.get(path)).json()
    assert (still["status"], still["suspended_reason"]) == ("suspended", "billing")

    forced = await client.post(f"{path}/reactivate", json={"force": True, "note": "paid by wire"})
    assert (forced.json()["status"], forced.json()["suspended_reason"]) == ("active", None)
    audit = (await client.get("/admin/v1/audit", params={"tenant_id": tenant.id})).json()["data"]
    assert [e["action"] for e in audit] == ["tenant.reactivate"]
    assert audit[0]["details"] == {"lifted_reason": "billing", "forced": True, "note": "paid by wire"}


async def test_reactivate_decides_on_the_row_after_a_concurrent_billing_suspension(
        api: AdminApi, client: httpx.AsyncClient) -> None:
    tenant = await create_tenant_api(client)
    path = f"/admin/v1/tenants/{tenant['id']}"
    await client.post(f"{path}/suspend")

    async def reactivate_is_waiting_for_the_row() -> bool:
        async with api.db.session() as probe:
            waiting = await probe.scalar(text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock'"))
        return bool(waiting)

    async with api.db.session() as billing:  # billing suspends the tenant while an admin reactivates it
        row = await billing.scalar(select(Tenant).where(Tenant.id == tenant["id"]).with_for_update())
        assert row is not None
        row.suspended_reason = "billing"
        await billing.flush()
        reactivation = asyncio.create_task(client.post(f"{path}/reactivate"))
        await eventually(reactivate_is_waiting_for_the_row, "the reactivation to wait for the row lock")
    assert_error(await reactivation, 409)
    final = (await client.get(path)).json()
    assert (final["status"], final["suspended_reason"]) == ("suspended", "billing")


# ------------------------------------------------------------------------------------------ keys


async def test_created_key_works_on_v1_and_revocation_reaches_the_gateway(api: AdminApi,
                                                                          client: httpx.AsyncClient) -> None:
    tenant = await create_tenant_api(client)
    expires = (datetime.now(UTC) + timedelta(days=30)).replace(microsecond=0)
    response = await client.post(f"/admin/v1/tenants/{tenant['id']}/keys",
                                 json={"name": "ci", "expires_at": expires.isoformat()})
    assert response.status_code == 201, response.text
    created = response.json()
    secret = created["key"]
    assert secret.startswith(f"sk-tg-{created['prefix']}-") and created["revoked_at"] is None
    assert datetime.fromisoformat(created["expires_at"]) == expires

    async with api.client({"Authorization": f"Bearer {secret}"}) as tenant_client:
        assert (await tenant_client.get("/v1/models")).status_code == 200  # cached for a day now

        listed = (await client.get(f"/admin/v1/tenants/{tenant['id']}/keys")).json()["data"]
        assert [(k["id"], k["name"], k["prefix"]) for k in listed] == [
            (created["id"], "ci", created["prefix"])]
        assert secret not in str(listed) and {"last_used_at", "expires_at", "revoked_at"} <= set(listed[0])

        revoked = await client.post(f"/admin/v1/tenants/{tenant['id']}/keys/{created['id']}/revoke")
        assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None

        async def refused() -> bool:
            return (await tenant_client.get("/v1/models")).status_code == 401

        await eventually(refused, "the gateway to refuse the revoked key")
        assert_error(await tenant_client.get("/v1/models"), 401)
    again = await client.post(f"/admin/v1/tenants/{tenant['id']}/keys/{created['id']}/revoke")
    assert again.json()["revoked_at"] == revoked.json()["revoked_at"]  # idempotent


async def test_a_key_of_another_tenant_cannot_be_revoked_through_this_one(client: httpx.AsyncClient) -> None:
    owner, other = await create_tenant_api(client), await create_tenant_api(client)
    key = (await client.post(f"/admin/v1/tenants/{owner['id']}/keys", json={})).json()
    assert_error(await client.post(f"/admin/v1/tenants/{other['id']}/keys/{key['id']}/revoke"), 404)
    assert (await client.get(f"/admin/v1/tenants/{owner['id']}/keys")).json()["data"][0]["revoked_at"] is None


# ------------------------------------------------------------------------------------------ prices


async def test_add_and_list_prices_with_effective_dates(client: httpx.AsyncClient) -> None:
    model = unique("model")
    soon = (datetime.now(UTC) + timedelta(days=1)).replace(microsecond=0)
    later = soon + timedelta(days=30)
    now_row = await client.post("/admin/v1/prices", json={"model": model, "input_usd_per_mtok": "3",
                                                          "output_usd_per_mtok": 15})
    assert now_row.status_code == 201, now_row.text
    assert now_row.json()["pico_usd_per_token"] == {
        "input": 3_000_000, "cached_input": 300_000, "output": 15_000_000,
        "batch_input": 1_500_000, "batch_cached_input": 150_000, "batch_output": 7_500_000,
        "embedding_input": 3_000_000, "batch_embedding_input": 1_500_000, "cache_write": 0, "cache_pin": 0,
        "cache_retention": 0, "batch_cache_write": 0, "batch_cache_pin": 0, "batch_cache_retention": 0}
    for start, price in ((soon, "2.5"), (later, "2")):
        response = await client.post("/admin/v1/prices", json={
            "model": model, "input_usd_per_mtok": price, "output_usd_per_mtok": "10",
            "cached_input_usd_per_mtok": "0.000001", "effective_from": start.isoformat()})
        assert response.status_code == 201, response.text
    # A row that has not taken effect yet may be replaced.
    replaced = await client.post("/admin/v1/prices", json={
        "model": model, "input_usd_per_mtok": "2.25", "output_usd_per_mtok": "10",
        "effective_from": soon.isoformat()})
    assert replaced.status_code == 201 and replaced.json()["usd_per_mtok"]["input"] == "2.25"

    rows = (await client.get("/admin/v1/prices", params={"model": model})).json()["data"]
    assert [datetime.fromisoformat(r["effective_from"]) for r in rows][1:] == [soon, later]
    # Omitted, a row starts once every gateway has loaded it (billing.prices.PRICE_LEAD): not yet.
    assert [r["in_effect"] for r in rows] == [False, False, False]
    assert datetime.fromisoformat(rows[0]["effective_from"]) > datetime.now(UTC)
    assert [r["effective_until"] and datetime.fromisoformat(r["effective_until"]) for r in rows] == [
        soon, later, None]
    assert rows[1]["pico_usd_per_token"]["input"] == 2_250_000
    assert rows[2]["pico_usd_per_token"]["cached_input"] == 1
    assert model in {r["model"] for r in (await client.get("/admin/v1/prices")).json()["data"]}


async def test_a_price_with_embedding_prices_reads_back(client: httpx.AsyncClient) -> None:
    model = unique("embedder")
    created = await client.post("/admin/v1/prices", json={
        "model": model, "input_usd_per_mtok": "3", "output_usd_per_mtok": "15",
        "embedding_input_usd_per_mtok": "0.02"})
    assert created.status_code == 201, created.text
    assert created.json()["usd_per_mtok"]["embedding_input"] == "0.02"
    [row] = (await client.get("/admin/v1/prices", params={"model": model})).json()["data"]
    assert row == created.json()
    pico = row["pico_usd_per_token"]
    assert (pico["input"], pico["embedding_input"], pico["batch_embedding_input"]) == (
        3_000_000, 20_000, 10_000)
    explicit = await client.post("/admin/v1/prices", json={
        "model": model, "input_usd_per_mtok": "3", "output_usd_per_mtok": "15",
        "embedding_input_usd_per_mtok": "0.02", "batch_embedding_input_usd_per_mtok": "0.015",
        "effective_from": (datetime.now(UTC) + timedelta(days=1)).isoformat()})
    assert explicit.status_code == 201, explicit.text
    assert explicit.json()["usd_per_mtok"]["batch_embedding_input"] == "0.015"
    assert_error(await client.post("/admin/v1/prices", json={
        "model": model, "input_usd_per_mtok": "3", "output_usd_per_mtok": "15",
        "embedding_input_usd_per_mtok": "-1"}), 400)


async def test_a_price_with_cache_prices_reads_back(client: httpx.AsyncClient) -> None:
    model = unique("cacher")
    created = await client.post("/admin/v1/prices", json={
        "model": model, "input_usd_per_mtok": "3", "output_usd_per_mtok": "15",
        "cache_write_usd_per_mtok": "3.75", "cache_pin_usd_per_mtok": "0.3",
        "cache_retention_usd_per_mtok": 0.1, "batch_cache_retention_usd_per_mtok": "0.04"})
    assert created.status_code == 201, created.text
    [row] = (await client.get("/admin/v1/prices", params={"model": model})).json()["data"]
    assert row == created.json()
    assert {k: v for k, v in row["pico_usd_per_token"].items() if "cache_" in k} == {
        "cache_write": 3_750_000, "cache_pin": 300_000, "cache_retention": 100_000,
        "batch_cache_write": 1_875_000, "batch_cache_pin": 150_000, "batch_cache_retention": 40_000}
    assert (row["usd_per_mtok"]["cache_write"], row["usd_per_mtok"]["batch_cache_write"]) == ("3.75", "1.875")
    for field in ("cache_write", "cache_pin", "cache_retention", "batch_cache_write", "batch_cache_pin",
                  "batch_cache_retention"):
        assert_error(await client.post("/admin/v1/prices", json={
            "model": model, "input_usd_per_mtok": "3", "output_usd_per_mtok": "15",
            f"{field}_usd_per_mtok": "-1"}), 400)
    assert_error(await client.post("/admin/v1/prices", json={
        "model": model, "input_usd_per_mtok": "3", "output_usd_per_mtok": "15",
        "cache_write_usd_per_mtok": "0.0000001"}), 400)


# ------------------------------------------------------------------------------------------ usage


async def test_usage_sums_equal_the_ledger_rows(api: AdminApi, client: httpx.AsyncClient) -> None:
    # A window of its own (a past day no other test writes to), so overall sums are this test's rows.
    day = datetime(2001, 1, 1, tzinfo=UTC) + timedelta(days=uuid.uuid4().int % 3000)
    async with api.db.session() as session:
        first, second = await create_tenant(session), await create_tenant(session)
        rows = [
            (first, "alpha", "interactive", 100, 40, 10, day + timedelta(hours=1), (48, 96, 0)),
            (first, "alpha", "interactive", 300, 0, 50, day + timedelta(hours=1, minutes=59), (288, 0, 288)),
            (first, "alpha", "batch", 1000, 500, 200, day + timedelta(hours=5), (496, 992, 992)),
            (first, "beta", "interactive", 7, 0, 3, day + timedelta(days=1, hours=2), (0, 0, 0)),
            (second, "alpha", "interactive", 50, 10, 5, day + timedelta(hours=3), (32, 48, 48)),
        ]
        # Predicted Outputs: of each row's completion tokens, a third accepted and a seventh rejected.
        events = [await create_usage_event(session, tenant, model=model, request_class=klass, prompt_tokens=p,
                                           cached_tokens=c, completion_tokens=o, created_at=at,
                                           accepted_prediction_tokens=o // 3,
                                           rejected_prediction_tokens=o // 7,
                                           **dict(zip(CACHE_TOKEN_FIELDS, cache, strict=True)))
                  for tenant, model, klass, p, c, o, at, cache in rows]
        # Outside the window: must not count.
        await create_usage_event(session, first, created_at=day - timedelta(seconds=1))
        await create_usage_event(session, first, created_at=day + timedelta(days=2))
    window = {"start": day.isoformat(), "end": (day + timedelta(days=2)).isoformat()}

    def expect(selected: list[Any]) -> dict[str, Any]:
        cost = sum(e.cost_pico_usd for e in selected)
        return {"requests": len(selected),
                **{name: sum(getattr(e, name) for e in selected) for name in FIELDS},
                "cost_pico_usd": str(cost), "cost_usd": format((Decimal(cost) / 10**12).normalize(), "f")}

    def totals(row: dict[str, Any]) -> dict[str, Any]:
        return {k: row[k] for k in ("requests", *FIELDS, "cost_pico_usd", "cost_usd")}

    mine = [e for e in events if e.tenant_id == first.id]
    report = (await client.get(f"/admin/v1/tenants/{first.id}/usage", params={**window,
                                                                               "group_by": "model"})).json()
    assert report["totals"] == expect(mine) and report["tenant_id"] == first.id
    predicted = report["totals"]["accepted_prediction_tokens"], report["totals"]["rejected_prediction_tokens"]
    assert predicted == (3 + 16 + 66 + 1, 1 + 7 + 28 + 0)
    assert {r["model"]: totals(r) for r in report["data"]} == {
        model: expect([e for e in mine if e.model == model]) for model in ("alpha", "beta")}

    by_class_day = (await client.get(f"/admin/v1/tenants/{first.id}/usage", params={
        **window, "group_by": ["request_class"], "granularity": "day"})).json()
    assert [(datetime.fromisoformat(r["bucket_start"]), r["request_class"], r["requests"])
            for r in by_class_day["data"]] == [(day, "batch", 1), (day, "interactive", 2),
                                               (day + timedelta(days=1), "interactive", 1)]
    hourly = (await client.get(f"/admin/v1/tenants/{first.id}/usage",
                               params={**window, "granularity": "hour"})).json()["data"]
    assert [(datetime.fromisoformat(r["bucket_start"]) - day, r["requests"]) for r in hourly] == [
        (timedelta(hours=1), 2), (timedelta(hours=5), 1), (timedelta(days=1, hours=2), 1)]

    overall = (await client.get("/admin/v1/usage", params={**window, "group_by": "tenant_id,model"})).json()
    assert overall["totals"] == expect(events) and overall["tenant_id"] is None
    assert {(r["tenant_id"], r["model"]): r["requests"] for r in overall["data"]} == {
        (first.id, "alpha"): 3, (first.id, "beta"): 1, (second.id, "alpha"): 1}
    only_second = (await client.get("/admin/v1/usage", params={**window, "tenant_id": second.id})).json()
    assert only_second["totals"] == expect([events[4]]) and len(only_second["data"]) == 1

    empty = (await client.get(f"/admin/v1/tenants/{first.id}/usage", params={
        "start": "1990-01-01T00:00:00Z", "end": "1990-02-01T00:00:00Z"})).json()
    assert empty["data"] == [] and empty["totals"]["cost_pico_usd"] == "0"


async def test_usage_cost_is_exact_beyond_float_precision(api: AdminApi, client: httpx.AsyncClient) -> None:
    day = datetime(1999, 1, 1, tzinfo=UTC) + timedelta(days=uuid.uuid4().int % 300)
    big = 2**62 + 1  # two of them overflow BIGINT and a double's 53-bit mantissa
    async with api.db.session() as session:
        tenant = await create_tenant(session)
        for minute in (1, 2):
            await create_usage_event(session, tenant, cost_pico_usd=big,
                                     created_at=day + timedelta(minutes=minute))
    report = (await client.get(f"/admin/v1/tenants/{tenant.id}/usage", params={
        "start": day.isoformat(), "end": (day + timedelta(hours=1)).isoformat()})).json()
    assert report["totals"]["cost_pico_usd"] == str(2 * big)
    assert Decimal(report["totals"]["cost_usd"]) * 10**12 == 2 * big


# ------------------------------------------------------------------------------------------ audit


async def test_every_admin_write_is_in_the_audit_log(api: AdminApi, client: httpx.AsyncClient) -> None:
    tenant = await create_tenant_api(client)
    path = f"/admin/v1/tenants/{tenant['id']}"
    await client.patch(path, json={"rpm_limit": 5})
    await client.post(f"{path}/suspend")
    await client.post(f"{path}/reactivate")
    key = (await client.post(f"{path}/keys", json={"name": "audited"})).json()
    await client.post(f"{path}/keys/{key['id']}/revoke")
    model = unique("audited-model")
    await client.post("/admin/v1/prices",
                      json={"model": model, "input_usd_per_mtok": 1, "output_usd_per_mtok": 2})

    entries = (await client.get("/admin/v1/audit", params={"tenant_id": tenant["id"]})).json()
    assert [e["action"] for e in entries["data"]] == [
        "api_key.revoke", "api_key.create", "tenant.reactivate", "tenant.suspend", "tenant.update",
        "tenant.create"]
    assert {e["actor"] for e in entries["data"]} == {f"admin:{api.email}"}
    assert {e["tenant_id"] for e in entries["data"]} == {tenant["id"]}
    assert entries["data"][4]["details"] == {"rpm_limit": 5}
    assert entries["data"][0]["details"]["api_key_id"] == key["id"]

    page = (await client.get("/admin/v1/audit", params={"tenant_id": tenant["id"], "limit": 2})).json()
    assert [e["action"] for e in page["data"]] == ["api_key.revoke", "api_key.create"] and page["has_more"]
    rest = (await client.get("/admin/v1/audit", params={"tenant_id": tenant["id"],
                                                         "before_id": page["data"][-1]["id"]})).json()
    assert len(rest["data"]) == 4 and not rest["has_more"]
    prices = (await client.get("/admin/v1/audit", params={"action": "price.set", "limit": 50})).json()["data"]
    assert any(e["details"]["model"] == model and e["tenant_id"] is None for e in prices)


async def test_failed_writes_leave_no_audit_row(client: httpx.AsyncClient) -> None:
    tenant = await create_tenant_api(client)
    await client.patch(f"/admin/v1/tenants/{tenant['id']}", json={"tier": "gold"})
    await client.post("/admin/v1/tenants", json={"name": tenant["name"]})
    entries = (await client.get("/admin/v1/audit", params={"tenant_id": tenant["id"]})).json()["data"]
    assert [e["action"] for e in entries] == ["tenant.create"]


# ------------------------------------------------------------------------------------------ services


async def test_services_run_without_http_and_raise_gateway_errors(api: AdminApi) -> None:
    from gateway.admin.schemas import TenantCreateRequest, TenantUpdateRequest
    from gateway.admin.uow import admin_unit_of_work

    async with admin_unit_of_work(api.db, api.app.state.redis) as session:
        tenant = await service.create_tenant(session, TenantCreateRequest(name=unique("svc")),
                                             settings=api.settings, actor="dashboard:test")
        await service.update_tenant(session, tenant.id, TenantUpdateRequest(rpm_limit=3),
                                    settings=api.settings, actor="dashboard:test")
    with pytest.raises(GatewayError) as info:
        async with admin_unit_of_work(api.db, api.app.state.redis) as session:
            await service.update_tenant(session, tenant.id, TenantUpdateRequest(rpm_limit=4),
                                        settings=api.settings, actor="dashboard:test")
            await service.reactivate_tenant(session, 9_000_000_000, actor="x")
    assert info.value.status == 404
    async with api.db.session() as session:  # the failed unit of work was rolled back as a whole
        assert (await service.get_tenant(session, tenant.id, settings=api.settings)).rpm_limit == 3
