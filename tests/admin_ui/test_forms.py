"""Dashboard forms against the admin services: invalid input is re-rendered with the reason and changes
nothing; edits record only what changed; billing suspensions need an explicit override; a prompt-cache
purge reports each replica; every refusal is a page, never a stack trace."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from tests.admin_ui.conftest import Dashboard, login_client
from tests.factories import create_api_key, create_tenant
from tests.gateway.conftest import MODEL
from tollgate.models import AuditLog, Price, Tenant

# Meant for one worker sharing the gateway + engine + browser (pytest -n --dist loadgroup); with pytest 9
# and xdist 3.8 the group is not honoured, so each worker builds its own (slower, still correct).
pytestmark = pytest.mark.xdist_group("admin_ui")


@pytest.fixture
async def admin_client(dashboard: Dashboard) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    async with httpx.AsyncClient(base_url=dashboard.url) as client:
        token = await login_client(dashboard, client)
        yield client, token


async def _tenant(dashboard: Dashboard, **columns: Any) -> Tenant:
    async with dashboard.db.session() as session:
        return await create_tenant(session, **columns)


async def _audit(dashboard: Dashboard, tenant_id: int) -> list[tuple[str, dict[str, Any]]]:
    async with dashboard.db.session() as session:
        rows = await session.scalars(select(AuditLog).where(AuditLog.tenant_id == tenant_id)
                                     .order_by(AuditLog.id))
        return [(row.action, row.details) for row in rows]


async def test_invalid_tenant_input_is_explained(dashboard: Dashboard,
                                                 admin_client: tuple[httpx.AsyncClient, str]) -> None:
    client, token = admin_client
    existing = await _tenant(dashboard)
    cases = [
        ({"name": "neg-limit", "rpm_limit": "-1"}, 400, "rpm limit"),
        ({"name": "sub-pico", "monthly_budget_usd": "0.0000000000001"}, 400, "pico"),
        ({"name": "bad tier", "tier": "platinum"}, 400, "unknown tier"),
        ({"name": "-starts-with-dash"}, 400, "name: String should match pattern"),
        ({"name": existing.name}, 409, "already exists"),
    ]
    for form, status, message in cases:
        response = await client.post("/admin/tenants", data={**form, "csrf_token": token})
        assert response.status_code == status, form
        assert message in response.text, (form, response.text[-2000:])
    async with dashboard.db.session() as session:
        names = set(await session.scalars(select(Tenant.name)))
    assert not names & {"neg-limit", "sub-pico", "bad tier"}


async def test_edits_record_only_what_changed(dashboard: Dashboard,
                                              admin_client: tuple[httpx.AsyncClient, str]) -> None:
    client, token = admin_client
    tenant = await _tenant(dashboard, tpm_limit=5000, rpm_limit=60, monthly_budget_pico_usd=10 * 10**12)
    form = {"csrf_token": token, "tier": "default", "tpm_limit": "5000", "rpm_limit": "60",
            "max_concurrency": "", "batch_tpd_limit": "", "monthly_budget_usd": "10.00"}
    same = await client.post(f"/admin/tenants/{tenant.id}/limits", data=form)
    assert same.status_code == 303 and same.headers["location"].endswith("done=unchanged")
    changed = await client.post(f"/admin/tenants/{tenant.id}/limits",
                                data={**form, "rpm_limit": "", "max_concurrency": "4", "tier": "flex"})
    assert changed.status_code == 303
    page = await client.get(changed.headers["location"])
    assert "Limits saved" in page.text
    assert await _audit(dashboard, tenant.id) == [
        ("tenant.update", {"tier": "flex", "rpm_limit": None, "max_concurrency": 4})]
    async with dashboard.db.session() as session:
        row = await session.get(Tenant, tenant.id)
    assert row is not None and (row.tier, row.rpm_limit, row.max_concurrency, row.tpm_limit) == (
        "flex", None, 4, 5000)
    bad = await client.post(f"/admin/tenants/{tenant.id}/limits", data={**form, "tpm_limit": "lots"})
    assert bad.status_code == 400 and "tpm limit" in bad.text


async def test_billing_suspension_needs_the_override(dashboard: Dashboard,
                                                     admin_client: tuple[httpx.AsyncClient, str]) -> None:
    client, token = admin_client
    tenant = await _tenant(dashboard, status="suspended", suspended_reason="billing")
    page = await client.get(f"/admin/tenants/{tenant.id}")
    assert 'id="suspend-form"' not in page.text and 'name="force"' in page.text
    refused = await client.post(f"/admin/tenants/{tenant.id}/reactivate", data={"csrf_token": token})
    assert refused.status_code == 409 and "force" in refused.text
    lifted = await client.post(f"/admin/tenants/{tenant.id}/reactivate",
                               data={"csrf_token": token, "force": "on", "note": "paid by wire"})
    assert lifted.status_code == 303
    assert await _audit(dashboard, tenant.id) == [("tenant.reactivate", {
        "lifted_reason": "billing", "forced": True, "note": "paid by wire"})]


async def test_purging_the_prompt_cache_reports_each_replica(
        dashboard: Dashboard, admin_client: tuple[httpx.AsyncClient, str]) -> None:
    client, token = admin_client
    tenant = await _tenant(dashboard)
    async with dashboard.db.session() as session:
        _, key = await create_api_key(session, tenant, settings=dashboard.settings)
    chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "cache me " * 20}]}
    async with httpx.AsyncClient(base_url=f"{dashboard.url}/v1", headers={"Authorization": f"Bearer {key}"},
                                 timeout=60.0) as api:
        assert (await api.post("/chat/completions", json=chat)).status_code == 200
    assert 'id="purge-cache-form"' in (await client.get(f"/admin/tenants/{tenant.id}")).text
    purged = await client.post(f"/admin/tenants/{tenant.id}/purge-cache",
                               data={"csrf_token": token, "note": "erasure request"})
    assert purged.status_code == 200, purged.text[-2000:]
    # The engine answered; the batch pool's only replica is down, and the page says to retry it.
    assert re.search(r"Prompt cache purged: [1-9][\d,]* blocks? dropped on 1 of 2 replicas\.", purged.text)
    down = dashboard.settings.pools["batch"].replicas[0]
    assert f'<p class="error" role="alert">Not purged: {down}' in purged.text
    [(action, details)] = await _audit(dashboard, tenant.id)
    assert action == "tenant.purge_cache" and details["note"] == "erasure request"
    assert details["purged_blocks"] > 0 and set(details["failed"]) == {down}
    assert "tenant.purge_cache" in purged.text  # the page's audit log already shows it
    missing = await client.post("/admin/tenants/999999999/purge-cache", data={"csrf_token": token})
    assert missing.status_code == 404 and "no tenant" in missing.text
    forged = await client.post(f"/admin/tenants/{tenant.id}/purge-cache", data={"note": "no token"})
    assert forged.status_code == 403
    assert len(await _audit(dashboard, tenant.id)) == 1


async def test_refusals_render_pages(dashboard: Dashboard,
                                     admin_client: tuple[httpx.AsyncClient, str]) -> None:
    client, token = admin_client
    tenant = await _tenant(dashboard)
    past_key = await client.post(f"/admin/tenants/{tenant.id}/keys",
                                 data={"csrf_token": token, "name": "old", "expires_at": "2001-01-01T00:00"})
    assert past_key.status_code == 400 and "in the future" in past_key.text
    scoped = await client.post(f"/admin/tenants/{tenant.id}/keys",
                               data={"csrf_token": token, "name": "scoped", "allowed_models": "tiny, other "})
    assert scoped.status_code == 200 and "tiny, other" in scoped.text and 'id="new-key-secret"' in scoped.text
    note = "<script>alert(1)</script>"
    suspended = await client.post(f"/admin/tenants/{tenant.id}/suspend",
                                  data={"csrf_token": token, "note": note})
    page = await client.get(suspended.headers["location"])
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text and note not in page.text
    missing = await client.get("/admin/tenants/999999999")
    assert missing.status_code == 404 and "no tenant" in missing.text
    bad_range = await client.get("/admin/usage?start=2026-02-01&end=2026-01-01")
    assert bad_range.status_code == 400 and "must not be after" in bad_range.text
    bad_csv = await client.get("/admin/usage.csv?start=someday")
    assert bad_csv.status_code == 400 and "dates must look like" in bad_csv.text
    unknown_batch = await client.post("/admin/batches/batch_nope/cancel", data={"csrf_token": token})
    assert unknown_batch.status_code == 404 and "batch_nope" in unknown_batch.text
    past_price = await client.post("/admin/prices", data={"csrf_token": token, "model": "m",
                                                          "effective_from": "2001-01-01T00:00",
                                                          "input": "1", "output": "2"})
    assert past_price.status_code == 400 and "must not be in the past" in past_price.text
    no_price = await client.post("/admin/prices", data={"csrf_token": token, "model": "m", "input": "x",
                                                        "output": "2"})
    assert no_price.status_code == 400
    # A record id that is no value of its key (sqladmin's conversion raised: a 500) is not found.
    for path in ("/admin/db/audit-log/details/abc", "/admin/db/budget-alert/details/x1",
                 f"/admin/db/audit-log/details/{2**70}"):
        assert (await client.get(path)).status_code == 404, path


async def test_a_price_with_embedding_prices_shows_in_the_table(
        dashboard: Dashboard, admin_client: tuple[httpx.AsyncClient, str]) -> None:
    client, token = admin_client
    added = await client.post("/admin/prices", data={
        "csrf_token": token, "model": "form-embedder", "input": "3", "output": "15",
        "embedding_input": "0.02", "batch_embedding_input": "0.015"})
    assert added.status_code == 303, added.text
    page = (await client.get(added.headers["location"])).text
    assert "embedding input" in page and "batch embedding input" in page
    assert "$0.02" in page and "$0.015" in page
    async with dashboard.db.session() as session:
        row = await session.scalar(select(Price).where(Price.model == "form-embedder"))
    assert row is not None and (row.embedding_input, row.batch_embedding_input) == (20_000, 15_000)


async def test_a_price_with_cache_prices_shows_in_the_table(
        dashboard: Dashboard, admin_client: tuple[httpx.AsyncClient, str]) -> None:
    client, token = admin_client
    added = await client.post("/admin/prices", data={
        "csrf_token": token, "model": "form-cacher", "input": "3", "output": "15", "cache_write": "3.75",
        "cache_pin": "0.3", "cache_retention": "0.1", "batch_cache_retention": "0.04"})
    assert added.status_code == 303, added.text
    page = (await client.get(added.headers["location"])).text
    for header in ("cache write", "cache pin", "cache retention", "batch cache write", "batch cache pin",
                   "batch cache retention"):
        assert f">{header}</th>" in page
    assert "$3.75" in page and "$1.875" in page and "$0.04" in page
    async with dashboard.db.session() as session:
        row = await session.scalar(select(Price).where(Price.model == "form-cacher"))
    assert row is not None
    assert (row.cache_write, row.cache_pin, row.cache_retention) == (3_750_000, 300_000, 100_000)
    assert (row.batch_cache_write, row.batch_cache_pin, row.batch_cache_retention) == (
        1_875_000, 150_000, 40_000)
    refused = await client.post("/admin/prices", data={
        "csrf_token": token, "model": "form-cacher", "input": "3", "output": "15", "cache_pin": "-1"})
    assert refused.status_code == 400 and "cache pin" in refused.text
