"""The dashboard's usage pages show Predicted Outputs next to the other counts: a tenant's accepted and
rejected prediction tokens from the ledger in the totals, the chart data, the by-tenant table, the CSV
export and the tenant page's month to date (served HTML, no browser)."""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import httpx
import pytest
from sqlalchemy import func, select

from billing.ledger import UsageFlusher
from billing.outbox import PREDICTION_TOKEN_FIELDS, UsageRecord, append_usage
from tests.admin_ui.conftest import Dashboard, login_client
from tests.factories import create_tenant
from tests.gateway.conftest import MODEL
from tollgate.models import UsageEvent

pytestmark = pytest.mark.xdist_group("admin_ui")

# (completion, accepted, rejected); the cost ranks the tenant first among the dashboard's tenants.
USAGE = [(120, 70, 30), (40, 0, 0), (900, 610, 155)]
ACCEPTED, REJECTED = (sum(row[i] for row in USAGE) for i in (1, 2))


@pytest.fixture
async def admin_client(dashboard: Dashboard) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=dashboard.url, timeout=30) as client:
        await login_client(dashboard, client)
        yield client


async def _ledgered(dashboard: Dashboard, tenant_id: int) -> int:
    await UsageFlusher(dashboard.redis, dashboard.db.session, consumer="admin-ui-predictions").flush()
    async with dashboard.db.session() as session:
        return int(await session.scalar(select(func.count()).where(UsageEvent.tenant_id == tenant_id)) or 0)


def _attribute(html: str, name: str) -> str:
    found = re.search(rf'{name}="([^"]*)"', html)
    assert found is not None, name
    return found[1]


async def test_usage_pages_show_accepted_and_rejected_prediction_tokens(
        dashboard: Dashboard, admin_client: httpx.AsyncClient) -> None:
    async with dashboard.db.session() as session:
        tenant = await create_tenant(session)
    for i, (completion, accepted, rejected) in enumerate(USAGE):
        await append_usage(dashboard.redis, UsageRecord.of(
            request_id=f"predictions-page-{tenant.id}-{i}", tenant_id=tenant.id, api_key_id=None, model=MODEL,
            request_class="interactive", tier="default", prompt_tokens=50, cached_tokens=0,
            completion_tokens=completion, cost_pico_usd=10**15, status="completed", ttft_ms=None,
            tpot_ms=None, created_at=datetime.now(UTC), accepted_prediction_tokens=accepted,
            rejected_prediction_tokens=rejected))
    assert await _ledgered(dashboard, tenant.id) == len(USAGE)

    page = await admin_client.get(f"/admin/usage?tenant_id={tenant.id}")
    assert page.status_code == 200, page.text
    html = page.text
    assert _attribute(html, "data-accepted-prediction-tokens") == str(ACCEPTED)
    assert _attribute(html, "data-rejected-prediction-tokens") == str(REJECTED)
    shown = re.search(r'id="prediction-tokens">.*?<p class="big">([^<]*)</p>', html, re.S)
    assert shown is not None and shown[1] == f"{ACCEPTED:,} / {REJECTED:,}"
    embedded = re.search(r'<script type="application/json" id="usage-data">(.*?)</script>', html, re.S)
    assert embedded is not None
    data = json.loads(embedded[1])
    assert [sum(data[name]) for name in PREDICTION_TOKEN_FIELDS] == [ACCEPTED, REJECTED]
    assert [data["totals"][name] for name in PREDICTION_TOKEN_FIELDS] == [ACCEPTED, REJECTED]
    assert 'id="chart-predictions"' in html

    everyone = (await admin_client.get("/admin/usage")).text
    row = re.search(rf'<tr data-tenant-id="{tenant.id}">(.*?)</tr>', everyone, re.S)
    assert row is not None
    cell = re.search(r'<td class="num prediction">([^<]*)</td>', row[1])
    assert cell is not None and cell[1] == f"{ACCEPTED:,} / {REJECTED:,}"

    export = await admin_client.get(f"/admin/usage.csv?tenant_id={tenant.id}")
    assert export.status_code == 200 and export.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(export.text)))
    assert [sum(int(r[name]) for r in rows) for name in PREDICTION_TOKEN_FIELDS] == [ACCEPTED, REJECTED]
    assert sum(int(r["output_tokens"]) for r in rows) == sum(row[0] for row in USAGE)

    tenant_page = (await admin_client.get(f"/admin/tenants/{tenant.id}")).text
    month = re.search(r'<dd id="mtd-prediction">([^<]*)</dd>', tenant_page)
    assert month is not None and month[1] == f"{ACCEPTED:,} / {REJECTED:,}"
