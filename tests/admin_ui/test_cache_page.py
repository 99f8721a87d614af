"""The dashboard's prompt-cache page in a real browser: a tenant's hit rate and where its hits came from
(device / host / disk, from the ledger), what it wrote, pinned and retained; and the replicas' cache by
tier as they report it in ``GET /load``."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from playwright.async_api import expect

from billing.outbox import UsageRecord, append_usage
from tests.admin_ui.conftest import Dashboard, screenshot
from tests.admin_ui.test_dashboard_browser import _flush_until_ledgered, _log_in
from tests.factories import create_api_key, create_tenant
from tests.gateway.conftest import MODEL
from tests.polling import eventually

pytestmark = pytest.mark.xdist_group("admin_ui")


async def _looked_up(dashboard: Dashboard) -> bool:
    route = dashboard.app.state.gateway.router.models[MODEL]
    return any(r.load is not None and r.load.cache is not None and r.load.cache.query_tokens > 0
               for r in route.replicas)

# (prompt, cached, of which from host, from disk, (written, pinned, retained)); the price makes cost 0.
USAGE = [(1000, 800, 320, 160, (192, 800, 0)), (600, 400, 0, 240, (0, 0, 400))]


async def test_the_cache_page_shows_hits_by_tier_per_tenant_and_replica(page: Any,
                                                                         dashboard: Dashboard) -> None:
    async with dashboard.db.session() as session:
        tenant, caller = await create_tenant(session), await create_tenant(session)
        _, key = await create_api_key(session, caller, settings=dashboard.settings)
    async with httpx.AsyncClient(base_url=f"{dashboard.url}/v1", timeout=60.0,
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello " * 40}]}
        assert (await client.post("/chat/completions", json=chat)).status_code == 200
        # The replica's next /load (what the router polls) counts the prompt it looked up.
        await eventually(lambda: _looked_up(dashboard), "the router to poll the replica's cache report")
    for i, (prompt, cached, host, disk, (written, pinned, retained)) in enumerate(USAGE):
        await append_usage(dashboard.redis, UsageRecord.of(
            request_id=f"cache-page-{tenant.id}-{i}", tenant_id=tenant.id, api_key_id=None, model=MODEL,
            request_class="interactive", tier="default", prompt_tokens=prompt, cached_tokens=cached,
            completion_tokens=10, cost_pico_usd=0, status="completed", ttft_ms=None, tpot_ms=None,
            created_at=datetime.now(UTC), cache_write_tokens=written, cache_pinned_tokens=pinned,
            cache_retained_tokens=retained, cached_host_tokens=host, cached_disk_tokens=disk))
    assert (await _flush_until_ledgered(dashboard, tenant.id, len(USAGE)))["requests"] == len(USAGE)

    await _log_in(page, dashboard)
    await page.goto("/admin/cache?window=1h")
    row = page.locator(f'#cache-tenants tr[data-tenant-id="{tenant.id}"]')
    await expect(row).to_contain_text(tenant.name)
    cells = row.locator("td")
    await expect(cells.nth(2)).to_have_text("1,600")  # prompt tokens
    await expect(cells.nth(3)).to_have_text("1,200")  # cached
    await expect(cells.nth(4)).to_have_text("75.0%")  # hit rate
    # Of the 1,200 cached tokens: 320 from host, 400 from disk, the other 480 from the device pool.
    await expect(row.locator('td[data-tier="device"]')).to_have_text("40.0%")
    await expect(row.locator('td[data-tier="host"]')).to_have_text("26.7%")
    await expect(row.locator('td[data-tier="disk"]')).to_have_text("33.3%")
    await expect(cells.last).to_have_text("192 / 800 / 400")
    # The session's engine runs without lower tiers: its cache report has hit rates, no host or disk rows.
    replica = page.locator("#cache-replicas tbody tr").first
    await expect(replica.locator('td[data-tier="host"]')).to_have_text("0.0%")
    await expect(replica.locator('td[data-tier="disk"]')).to_have_text("0.0%")
    await expect(replica.locator("td.tiers")).to_have_text("none")
    await screenshot(page, "16-prompt-cache")
