"""An admin's day in a real browser (Playwright on Debian's chromium) against the running gateway:
log in, create a tenant and a key, change its quota and see the gateway enforce it, make a request and
find it in the usage chart with the ledger's numbers, watch SLOs and replicas, cancel a batch, add a
price, purge the tenant's prompt cache, suspend/reactivate, revoke the key, log out; and the
prompt-cache products (tokens written, pinned, retained and their cost) on the usage pages. Every page
is screenshotted to ``test-artifacts/screenshots/``."""

from __future__ import annotations

import csv
import io
import json
import re
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from playwright.async_api import expect
from sqlalchemy import func, select

from billing.ledger import UsageFlusher
from billing.outbox import UsageRecord, append_usage
from billing.prices import CACHE_TOKEN_FIELDS, Price, cost_pico_usd
from gateway.admin.schemas import usd_string
from tests.admin_ui.conftest import ADMIN_PASSWORD, Dashboard, screenshot
from tests.factories import create_price, create_tenant
from tests.gateway.conftest import MODEL
from tollgate.models import AuditLog, UsageEvent

# Meant for one worker sharing the gateway + engine + browser (pytest -n --dist loadgroup); with pytest 9
# and xdist 3.8 the group is not honoured, so each worker builds its own (slower, still correct).
pytestmark = [pytest.mark.xdist_group("admin_ui"), pytest.mark.slow]

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there, dashboard!"}], "max_tokens": 8}
LEDGER_TIMEOUT_S = 30.0


async def _ledger(dashboard: Dashboard, tenant_id: int) -> dict[str, int]:
    async with dashboard.db.session() as session:
        row = (await session.execute(select(
            func.count(), func.coalesce(func.sum(UsageEvent.prompt_tokens), 0),
            func.coalesce(func.sum(UsageEvent.cached_tokens), 0),
            func.coalesce(func.sum(UsageEvent.completion_tokens), 0),
            func.coalesce(func.sum(UsageEvent.cost_pico_usd), 0),
        ).where(UsageEvent.tenant_id == tenant_id))).one()
    requests, prompt, cached, completion, cost = (int(v) for v in row)
    return {"requests": requests, "input": prompt - cached, "cached": cached, "output": completion,
            "cost": cost}


async def _flush_until_ledgered(dashboard: Dashboard, tenant_id: int, requests: int) -> dict[str, int]:
    """Run the ledger flusher (what beat schedules) until the tenant's requests are in Postgres."""
    flusher = UsageFlusher(dashboard.redis, dashboard.db.session, consumer="admin-ui-test")
    deadline = time.monotonic() + LEDGER_TIMEOUT_S
    while True:
        await flusher.flush()
        ledger = await _ledger(dashboard, tenant_id)
        if ledger["requests"] >= requests or time.monotonic() > deadline:
            return ledger


async def _chart_sums(page: Any, chart_id: str) -> dict[str, float]:
    await page.wait_for_function("(id) => window.Chart && Chart.getChart(id) !== undefined", arg=chart_id)
    return await page.evaluate(
        """(id) => Object.fromEntries(Chart.getChart(id).data.datasets.map(
               (d) => [d.label, d.data.reduce((a, b) => a + (b || 0), 0)]))""", chart_id)


async def _create_batch(dashboard: Dashboard, key: str) -> str:
    line = {"custom_id": "line-1", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}
    async with httpx.AsyncClient(base_url=f"{dashboard.url}/v1", headers={"Authorization": f"Bearer {key}"},
                                 timeout=30.0) as client:
        upload = await client.post("/files", data={"purpose": "batch"},
                                   files={"file": ("input.jsonl", json.dumps(line).encode() + b"\n")})
        assert upload.status_code == 200, upload.text
        batch = await client.post("/batches", json={"input_file_id": upload.json()["id"],
                                                    "endpoint": "/v1/chat/completions",
                                                    "completion_window": "24h"})
        assert batch.status_code == 200, batch.text
    return batch.json()["id"]


async def test_admin_journey(page: Any, dashboard: Dashboard) -> None:
    # Anonymous: the dashboard is only the login page.
    await page.goto("/admin/usage")
    await expect(page).to_have_url(re.compile(r"/admin/login\?next=%2Fadmin%2Fusage$"))
    await screenshot(page, "01-login")
    await page.fill("input[name=email]", dashboard.admin_email)
    await page.fill("input[name=password]", "wrong password")
    await page.click("#login-form button[type=submit]")
    await expect(page.locator("p.error")).to_have_text("Incorrect email or password.")
    await page.fill("input[name=password]", ADMIN_PASSWORD)
    await page.click("#login-form button[type=submit]")
    await expect(page).to_have_url(re.compile(r"/admin/usage$"))

    # Create a tenant.
    await page.goto("/admin/tenants")
    name = f"browser-{uuid.uuid4().hex[:8]}"
    await page.click("#create-tenant summary")
    create = page.locator("#create-tenant form")
    await create.locator("input[name=name]").fill(name)
    await create.locator("input[name=tpm_limit]").fill("100000")
    await create.locator("input[name=monthly_budget_usd]").fill("25.50")
    await screenshot(page, "02-tenants-create")
    await create.locator("button[type=submit]").click()
    await expect(page.locator("p.notice")).to_have_text("Tenant created.")
    tenant_id = int(re.search(r"/admin/tenants/(\d+)", page.url)[1])  # type: ignore[index]

    # Search finds it.
    await page.goto(f"/admin/tenants?q={name}")
    await expect(page.locator("#tenants tbody tr")).to_have_count(1)
    await expect(page.locator("#tenants tbody")).to_contain_text("$25.5")
    await screenshot(page, "03-tenants-search")

    # Create a key: the secret is shown once, the list shows only its prefix.
    await page.goto(f"/admin/tenants/{tenant_id}")
    await page.fill("#key-form input[name=name]", "browser key")
    await page.click("#key-form button[type=submit]")
    secret = (await page.locator("#new-key-secret").text_content() or "").strip()
    assert secret.startswith("sk-tg-")
    await screenshot(page, "04-key-created")
    await page.goto(f"/admin/tenants/{tenant_id}")
    assert secret not in await page.content()
    await expect(page.locator("#keys tbody")).to_contain_text(secret[: len("sk-tg-") + 12] + "-…")
    headers = {"Authorization": f"Bearer {secret}"}
    batch_id = await _create_batch(dashboard, secret)

    # Change the quota: RPM 1. The gateway enforces it on the next requests.
    await page.fill("#limits-form input[name=rpm_limit]", "1")
    await page.click("#limits-form button[type=submit]")
    await expect(page.locator("p.notice")).to_contain_text("Limits saved")
    await expect(page.locator("#limits-form input[name=rpm_limit]")).to_have_value("1")
    async with httpx.AsyncClient(base_url=f"{dashboard.url}/v1", headers=headers, timeout=60.0) as client:
        first = await client.post("/chat/completions", json=CHAT)
        assert first.status_code == 200, first.text
        second = await client.post("/chat/completions", json=CHAT)
    assert second.status_code == 429 and second.json()["error"]["type"] == "requests"
    await page.reload()
    await expect(page.locator("#audit tbody")).to_contain_text("rpm_limit=1")
    await screenshot(page, "05-tenant-limits")

    # The request appears in the usage chart with the ledger's numbers.
    ledger = await _flush_until_ledgered(dashboard, tenant_id, 1)
    assert ledger["requests"] == 1 and ledger["output"] > 0 and ledger["cost"] > 0
    await page.goto(f"/admin/usage?tenant_id={tenant_id}")
    tokens = await _chart_sums(page, "chart-tokens")
    assert tokens == {"input (uncached)": ledger["input"], "cached input": ledger["cached"],
                      "output": ledger["output"]}
    requests = await _chart_sums(page, "chart-requests")
    assert requests == {"requests": 1, "rejected: requests/min": 1}
    cost = await _chart_sums(page, "chart-cost")
    assert abs(cost["cost (USD)"] - ledger["cost"] / 1e12) < 1e-12
    totals = page.locator("#usage-totals")
    await expect(totals).to_have_attribute("data-cost-pico-usd", str(ledger["cost"]))
    await expect(totals).to_have_attribute("data-output-tokens", str(ledger["output"]))
    await _chart_sums(page, "chart-cache")
    await screenshot(page, "06-usage-tenant")
    export = await page.request.get(f"/admin/usage.csv?tenant_id={tenant_id}")
    assert export.ok and export.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(await export.text())))
    assert sum(int(r["requests"]) for r in rows) == 1
    assert sum(int(r["cost_pico_usd"]) for r in rows) == ledger["cost"]
    assert sum(int(r["output_tokens"]) for r in rows) == ledger["output"]
    assert sum(int(r["rejected_rpm"]) for r in rows) == 1
    await page.goto("/admin/usage")
    await _chart_sums(page, "chart-tokens")
    mine = page.locator(f'#by-tenant tr[data-tenant-id="{tenant_id}"]')
    await expect(mine).to_contain_text(name)
    await expect(mine.locator("td").nth(7)).to_have_text("1")
    await screenshot(page, "07-usage-all")

    # SLOs and live replica load from the router's registry.
    await page.goto("/admin/engines?window=1h")
    replica = page.locator("#replicas tbody tr").first
    await expect(replica).to_contain_text("healthy")
    # What the routing index says it holds: device blocks of the requests above, no tiers configured.
    await expect(replica.locator("td").nth(10)).to_have_text(re.compile(r"^[1-9][\d,]* / 0 / 0$"))
    batch_replica = page.locator("#replicas tbody tr").nth(1)
    await expect(batch_replica).to_contain_text("batch")
    await expect(batch_replica.locator("td").nth(3)).to_contain_text("down")
    await expect(page.locator("#live-status")).to_contain_text("updated")
    await expect(page.locator('#tiers tr[data-tier="default"] td').nth(1)).not_to_have_text("0")
    await _chart_sums(page, "chart-kv")
    await screenshot(page, "08-engines")

    # Batches: the one created above, cancelled from the dashboard.
    await page.goto(f"/admin/batches?tenant_id={tenant_id}")
    row = page.locator(f'tr[data-batch-id="{batch_id}"]')
    await expect(row).to_contain_text("validating")
    await row.locator("button").click()
    await expect(page.locator("p.notice")).to_contain_text("Cancellation requested")
    await expect(page.locator(f'tr[data-batch-id="{batch_id}"]')).to_contain_text("cancel")
    await screenshot(page, "09-batches")

    # Prices: add a future row.
    await page.goto("/admin/prices")
    await page.click("#add-price summary")
    await page.fill("#add-price input[name=model]", "browser-model")
    await page.fill("#add-price input[name=effective_from]", "2031-01-01T00:00")
    await page.fill("#add-price input[name=input]", "2")
    await page.fill("#add-price input[name=output]", "8")
    await page.click("#add-price button[type=submit]")
    await expect(page.locator("p.notice")).to_have_text("Price added.")
    await expect(page.locator("#prices tbody")).to_contain_text("2031-01-01 00:00 UTC")
    await screenshot(page, "10-prices")

    # Purge the tenant's prompt cache: the engine drops its blocks, the batch pool's replica is down.
    await page.goto(f"/admin/tenants/{tenant_id}")
    await page.fill("#purge-cache-form input[name=note]", "browser test")
    await page.click("#purge-cache-form button[type=submit]")
    purged = re.compile(r"[1-9][\d,]* blocks? dropped on 1 of 2 replicas")
    await expect(page.locator("p.notice")).to_contain_text(purged)
    await expect(page.locator("p.error")).to_contain_text("Not purged: http://127.0.0.1:")
    await screenshot(page, "10b-tenant-purge-cache")

    # Suspend, reactivate, revoke: each enforced by the gateway and recorded in the audit log.
    await page.goto(f"/admin/tenants/{tenant_id}")
    await page.fill("#suspend-form input[name=note]", "browser test")
    await page.click("#suspend-form button[type=submit]")
    await expect(page.locator("#tenant-status")).to_have_text("suspended (admin)")
    async with httpx.AsyncClient(base_url=f"{dashboard.url}/v1", headers=headers, timeout=60.0) as client:
        assert (await client.post("/chat/completions", json=CHAT)).status_code == 403
        await page.click("#reactivate-form button[type=submit]")
        await expect(page.locator("#tenant-status")).to_have_text("active")
        await page.locator("#keys tbody button").click()
        await expect(page.locator("p.notice")).to_contain_text("Key revoked")
        assert (await client.post("/chat/completions", json=CHAT)).status_code == 401
    await screenshot(page, "11-tenant-audit")
    async with dashboard.db.session() as session:
        actions = set(await session.scalars(select(AuditLog.action).where(AuditLog.tenant_id == tenant_id)))
    assert {"tenant.create", "api_key.create", "tenant.update", "tenant.suspend", "tenant.reactivate",
            "api_key.revoke", "batch.cancel", "tenant.purge_cache"} <= actions

    # The read-only record browser (sqladmin) lists the ledger row behind the chart.
    records = await page.goto("/admin/db/usage-event/list")
    assert records.headers["cache-control"] == "no-store" and records.headers["x-frame-options"] == "DENY"
    await expect(page.locator("table")).to_contain_text(first.headers["x-request-id"])
    await screenshot(page, "12-records-ledger")
    await page.goto("/admin/db/audit-log/list")
    await expect(page.locator("table")).to_contain_text("tenant.reactivate")
    await screenshot(page, "13-records-audit")
    assert await page.locator("a:has-text('New'), a:has-text('Delete')").count() == 0

    await page.goto("/admin/no-such-page")
    await expect(page.locator("h2")).to_have_text("Not found")
    await screenshot(page, "14-not-found")

    # Logging out leaves only the login page.
    await page.click("#logout")
    await expect(page).to_have_url(re.compile(r"/admin/login$"))
    await page.goto(f"/admin/tenants/{tenant_id}")
    await expect(page).to_have_url(re.compile(r"/admin/login"))


async def _log_in(page: Any, dashboard: Dashboard) -> None:
    await page.goto("/admin/usage")
    await page.fill("input[name=email]", dashboard.admin_email)
    await page.fill("input[name=password]", ADMIN_PASSWORD)
    await page.click("#login-form button[type=submit]")
    await expect(page).to_have_url(re.compile(r"/admin/usage$"))


# $3.75 per million tokens written to the cache, $0.30 pinned, $0.10 retained; batch half.
CACHE_PRICE = Price.of(input=3_000_000, output=15_000_000, cache_write=3_750_000, cache_pin=300_000,
                       cache_retention=100_000)
# (class, prompt, cached, completion, (cache written, pinned, retained))
CACHE_USAGE = [("interactive", 1000, 200, 50, (784, 992, 992)), ("batch", 4000, 1000, 300, (2992, 0, 3984))]


async def test_usage_shows_the_prompt_cache_products(page: Any, dashboard: Dashboard) -> None:
    model = f"cache-model-{uuid.uuid4().hex[:6]}"
    async with dashboard.db.session() as session:
        tenant = await create_tenant(session)
        await create_price(session, model=model, input=CACHE_PRICE.input, output=CACHE_PRICE.output,
                           cache_write=CACHE_PRICE.cache_write, cache_pin=CACHE_PRICE.cache_pin,
                           cache_retention=CACHE_PRICE.cache_retention)
    costs = [0, 0, 0]
    for i, (klass, prompt, cached, completion, cache) in enumerate(CACHE_USAGE):
        counts = dict(zip(CACHE_TOKEN_FIELDS, cache, strict=True))
        await append_usage(dashboard.redis, UsageRecord.of(
            request_id=f"cache-usage-{tenant.id}-{i}", tenant_id=tenant.id, api_key_id=None, model=model,
            request_class=klass, tier="default", prompt_tokens=prompt, cached_tokens=cached,
            completion_tokens=completion,
            cost_pico_usd=cost_pico_usd(CACHE_PRICE, prompt, cached, completion, klass, **counts),
            status="completed", ttft_ms=None, tpot_ms=None, created_at=datetime.now(UTC), **counts))
        for k, (n, price) in enumerate(zip(cache, CACHE_PRICE.cache_for_class(klass), strict=True)):
            costs[k] += n * price
    ledger = await _flush_until_ledgered(dashboard, tenant.id, len(CACHE_USAGE))
    assert ledger["requests"] == len(CACHE_USAGE)
    written, pinned, retained = (sum(row[4][k] for row in CACHE_USAGE) for k in range(3))
    assert (written, pinned, retained) == (3776, 992, 4976)

    await _log_in(page, dashboard)
    await page.goto(f"/admin/usage?tenant_id={tenant.id}")
    products = await _chart_sums(page, "chart-cache-products")
    assert {k: v for k, v in products.items() if k != "cost (USD)"} == {
        "cache writes": written, "pinned (ttl)": pinned, "retained (24h)": retained}
    assert abs(products["cost (USD)"] - sum(costs) / 1e12) < 1e-12
    totals = page.locator("#usage-totals")
    expected = {"data-cache-write-tokens": written, "data-cache-pinned-tokens": pinned,
                "data-cache-retained-tokens": retained, "data-cache-cost-pico-usd": sum(costs),
                "data-cost-pico-usd": ledger["cost"]}
    for attribute, value in expected.items():
        await expect(totals).to_have_attribute(attribute, str(value))
    shown = page.locator("#cache-products")
    await expect(shown).to_contain_text("3,776 / 992 / 4,976")
    for cost in (sum(costs), *costs):
        await expect(shown).to_contain_text(f"${usd_string(cost)}")
    await screenshot(page, "15-usage-cache-products")

    export = await page.request.get(f"/admin/usage.csv?tenant_id={tenant.id}")
    rows = list(csv.DictReader(io.StringIO(await export.text())))
    assert [sum(int(r[name]) for r in rows) for name in CACHE_TOKEN_FIELDS] == [written, pinned, retained]
    assert [sum(int(r[f"{kind}_cost_pico_usd"]) for r in rows)
            for kind in ("cache_write", "cache_pinned", "cache_retained")] == costs

    await page.goto("/admin/usage")
    mine = page.locator(f'#by-tenant tr[data-tenant-id="{tenant.id}"]')
    await expect(mine.locator("td").nth(8)).to_have_text("3,776 / 992 / 4,976")
    await expect(mine.locator("td").nth(9)).to_have_text(f"${usd_string(sum(costs))}")
    await page.goto(f"/admin/tenants/{tenant.id}")
    await expect(page.locator("#mtd-cache")).to_have_text("3,776 / 992 / 4,976")
