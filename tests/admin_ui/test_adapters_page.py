"""A tenant's LoRA adapters on its dashboard page: an admin registers a PEFT bundle through the form (in
a real browser), sees the model id the tenant calls, the tenant's key serves it, and the admin deletes
it; a bundle that does not fit its base is re-rendered with the replica's reason and records nothing;
every change is an audit row."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import expect
from sqlalchemy import select

from tests.admin_ui.conftest import ADMIN_PASSWORD, Dashboard, login_client, screenshot
from tests.engine.test_lora_serving import strong_bundle
from tests.factories import create_api_key, create_tenant
from tests.gateway.conftest import MODEL
from tollgate.models import Adapter, AuditLog

pytestmark = pytest.mark.xdist_group("admin_ui")


async def _audit_actions(dashboard: Dashboard, tenant_id: int) -> list[str]:
    async with dashboard.db.session() as session:
        rows = await session.scalars(select(AuditLog.action).where(AuditLog.tenant_id == tenant_id)
                                     .order_by(AuditLog.id))
        return list(rows)


async def test_an_admin_registers_and_deletes_a_tenants_adapter_in_the_browser(
        page: Any, dashboard: Dashboard, dashboard_tiny_model: Path, tmp_path: Path) -> None:
    async with dashboard.db.session() as session:
        tenant = await create_tenant(session, name="Umbrella Labs")
        _, key = await create_api_key(session, tenant, settings=dashboard.settings)
    bundle = strong_bundle(dashboard_tiny_model, tmp_path / "bundle", 4, ["q_proj", "v_proj"], 4)

    await page.goto(f"/admin/login?next=/admin/tenants/{tenant.id}")
    await page.fill("input[name=email]", dashboard.admin_email)
    await page.fill("input[name=password]", ADMIN_PASSWORD)
    await page.click("#login-form button[type=submit]")
    await expect(page).to_have_url(re.compile(rf"/admin/tenants/{tenant.id}$"))
    await expect(page.locator("#adapters tbody")).to_contain_text("No adapters yet.")
    form = page.locator("#adapter-form")
    await form.locator("input[name=name]").fill("claims")
    await form.locator("select[name=base_model]").select_option(MODEL)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        await form.locator(f'input[name="{name}"]').set_input_files(str(bundle / name))
    await form.locator("button[type=submit]").click()
    notice = page.locator("p.notice")
    await expect(notice).to_contain_text(
        "Adapter registered: the tenant calls it as model ft:tiny:umbrella-labs:claims:")
    model = re.search(r"(ft:\S+)\.$", await notice.inner_text())[1]  # type: ignore[index]
    await expect(page.locator("#adapters tbody tr")).to_have_count(1)
    await expect(page.locator("#adapters tbody")).to_contain_text(model)
    await screenshot(page, "adapters-registered")

    async with httpx.AsyncClient(base_url=f"{dashboard.url}/v1", headers={"Authorization": f"Bearer {key}"},
                                 timeout=60.0) as api:
        served = await api.post("/completions", json={"model": model, "prompt": "hello", "max_tokens": 2})
        assert served.status_code == 200 and served.json()["model"] == model
        # The engines page: the replica holds the adapter read (its next /load says so).
        await page.goto("/admin/engines?window=1h")
        replica = page.locator("#replicas tbody tr").first
        await expect(replica.locator("td").nth(11)).to_have_text("both")
        await expect(replica.locator("td").nth(12)).to_have_text(re.compile(r"^[1-9]\d*$"))
        await page.goto(f"/admin/tenants/{tenant.id}")

        await page.locator("#adapters tbody tr button[type=submit]").click()
        await expect(page.locator("p.notice")).to_have_text(
            "Adapter deleted: its model is gone for the tenant.")
        await expect(page.locator("#adapters tbody")).to_contain_text("No adapters yet.")
        gone = await api.post("/completions", json={"model": model, "prompt": "hello", "max_tokens": 2})
        assert gone.status_code == 404
    assert await _audit_actions(dashboard, tenant.id) == ["adapter.create", "adapter.delete"]


async def test_a_bundle_that_does_not_fit_is_explained_and_records_nothing(
        dashboard: Dashboard, dashboard_tiny_model: Path, tmp_path: Path) -> None:
    async with dashboard.db.session() as session:
        tenant = await create_tenant(session)
    bundle = strong_bundle(dashboard_tiny_model, tmp_path / "bundle", 5, ["q_proj"], 4)
    files: dict[str, Any] = {name: (name, (bundle / name).read_bytes())
                             for name in ("adapter_config.json", "adapter_model.safetensors")}
    async with httpx.AsyncClient(base_url=dashboard.url, timeout=60.0) as client:
        token = await login_client(dashboard, client)
        url = f"/admin/tenants/{tenant.id}/adapters"
        broken = {**files, "adapter_config.json": ("adapter_config.json", b'{"peft_type": "LORA", "r": 0}')}
        refused = await client.post(url, data={"csrf_token": token, "name": "x", "base_model": MODEL},
                                    files=broken)
        assert refused.status_code == 400 and "r must be an integer" in refused.text
        unnamed = await client.post(url, data={"csrf_token": token, "name": "", "base_model": MODEL},
                                    files=files)
        assert unnamed.status_code == 400 and "Invalid &#39;name&#39;" in unnamed.text
        partial = await client.post(url, data={"csrf_token": token, "name": "y", "base_model": MODEL},
                                    files={"adapter_config.json": files["adapter_config.json"]})
        assert partial.status_code == 400 and "adapter_model.safetensors" in partial.text
        forged = await client.post(url, data={"name": "z", "base_model": MODEL}, files=files)
        assert forged.status_code == 403
    async with dashboard.db.session() as session:
        assert not list(await session.scalars(select(Adapter).where(Adapter.tenant_id == tenant.id)))
    assert await _audit_actions(dashboard, tenant.id) == []
