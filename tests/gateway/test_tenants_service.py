"""Tenant and API key services on real Postgres (each test rolled back)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError
from sqlalchemy import select

from gateway.admin.service import AdminConflict, reactivate_tenant
from gateway.tenants.keys import parse_key
from gateway.tenants.schemas import ApiKeyCreate, TenantCreate, TenantUpdate, pico_usd_from_usd
from gateway.tenants.service import (
    ApiKeyNotFound,
    ApiKeyService,
    InvalidApiKey,
    InvalidTenantData,
    TenantNameTaken,
    TenantNotFound,
    TenantService,
)
from tests.factories import create_api_key, create_tenant
from tollgate.models import ApiKey, AuditLog


async def test_create_tenant_stores_limits_and_audits(db_session, settings):
    service = TenantService(db_session, settings)
    tenant = await service.create_tenant(
        TenantCreate(name="acme", tier="priority", tpm_limit=90_000, rpm_limit=60, max_concurrency=4,
                     batch_tpd_limit=10**6, monthly_budget_pico_usd=pico_usd_from_usd("250.5")),
        actor="tester")
    assert tenant.id and tenant.status == "active" and tenant.suspended_reason is None
    assert tenant.monthly_budget_pico_usd == 250_500_000_000_000
    assert (await service.get_tenant("acme")).id == tenant.id
    assert (await service.get_tenant(str(tenant.id))).name == "acme"
    audit = (await db_session.scalars(select(AuditLog).where(AuditLog.tenant_id == tenant.id))).one()
    assert (audit.actor, audit.action, audit.details["tpm_limit"]) == ("tester", "tenant.create", 90_000)


async def test_duplicate_name_and_unknown_tier_are_refused(db_session, settings):
    service = TenantService(db_session, settings)
    await service.create_tenant(TenantCreate(name="dup"), actor="t")
    with pytest.raises(TenantNameTaken, match="already exists"):
        await service.create_tenant(TenantCreate(name="dup"), actor="t")
    with pytest.raises(InvalidTenantData, match="unknown tier 'gold'"):
        await service.create_tenant(TenantCreate(name="other", tier="gold"), actor="t")
    with pytest.raises(TenantNotFound):
        await service.get_tenant("nobody")


@pytest.mark.parametrize("fields", [{"name": ""}, {"name": "-x"}, {"name": "a" * 200},
                                    {"name": "ok", "tpm_limit": -1}, {"name": "ok", "surprise": 1}])
def test_invalid_tenant_input_is_a_validation_error(fields):
    with pytest.raises(ValidationError):
        TenantCreate(**fields)


@pytest.mark.parametrize(("amount", "pico"), [("0", 0), ("12.5", 12_500_000_000_000), ("0.000000000001", 1)])
def test_dollars_convert_to_exact_pico_usd(amount, pico):
    assert pico_usd_from_usd(amount) == pico


@pytest.mark.parametrize("amount", ["-1", "abc", "0.0000000000001", "NaN", "Infinity"])
def test_bad_dollar_amounts_are_refused(amount):
    with pytest.raises(ValueError):
        pico_usd_from_usd(amount)


async def test_update_applies_only_given_fields_and_none_clears_a_limit(db_session, settings):
    tenant = await create_tenant(db_session, tpm_limit=100, rpm_limit=10)
    service = TenantService(db_session, settings)
    updated = await service.update_tenant(tenant.id, TenantUpdate(tpm_limit=None, tier="flex"), actor="t")
    assert (updated.tpm_limit, updated.rpm_limit, updated.tier) == (None, 10, "flex")
    with pytest.raises(InvalidTenantData):
        await service.update_tenant(tenant.id, TenantUpdate(tier=None), actor="t")


async def test_suspend_and_resume_keep_status_and_reason_consistent(db_session, settings):
    tenant = await create_tenant(db_session)
    service = TenantService(db_session, settings)
    with pytest.raises(InvalidTenantData):
        await service.suspend(tenant.id, "bored", actor="t")
    suspended = await service.suspend(tenant.id, "billing", actor="t")
    assert (suspended.status, suspended.suspended_reason) == ("suspended", "billing")
    with pytest.raises(AdminConflict):
        await reactivate_tenant(db_session, tenant.id, actor="t")
    resumed = await reactivate_tenant(db_session, tenant.id, actor="t", force=True)
    assert (resumed.status, resumed.suspended_reason) == ("active", None)


async def test_created_key_is_stored_only_as_a_hash_and_resolves(db_session, settings):
    tenant = await create_tenant(db_session)
    keys = ApiKeyService(db_session, settings)
    data = ApiKeyCreate(name="ci", allowed_models=["tiny"])
    row, full_key = await keys.create_key(tenant.id, data, actor="t")
    key_id, secret = parse_key(full_key)
    assert row.prefix == key_id and secret not in row.key_hash and len(row.key_hash) == 64
    stored = (await db_session.scalars(select(ApiKey).where(ApiKey.id == row.id))).one()
    assert full_key not in repr(stored.__dict__)
    resolved_key, resolved_tenant = await keys.resolve(full_key)
    assert (resolved_key.id, resolved_tenant.id, resolved_key.allowed_models) == (row.id, tenant.id, ["tiny"])


async def test_resolve_refuses_wrong_revoked_expired_and_suspended(db_session, settings):
    keys = ApiKeyService(db_session, settings)
    tenant = await create_tenant(db_session)
    row, full_key = await create_api_key(db_session, tenant)
    tampered = full_key[:-1] + ("A" if full_key[-1] != "A" else "B")
    for bad in ("garbage", tampered):
        with pytest.raises(InvalidApiKey):
            await keys.resolve(bad)
    expiring, expiring_key = await create_api_key(db_session, tenant,
                                                  expires_at=datetime.now(UTC) + timedelta(hours=1))
    with pytest.raises(InvalidApiKey):
        await keys.resolve(expiring_key, now=datetime.now(UTC) + timedelta(hours=2))
    await keys.revoke_key(tenant.id, row.id, actor="t")
    with pytest.raises(InvalidApiKey):
        await keys.resolve(full_key)
    await TenantService(db_session, settings).suspend(tenant.id, "admin", actor="t")
    with pytest.raises(InvalidApiKey, match="suspended"):
        await keys.resolve(expiring_key)


async def test_keys_are_scoped_to_their_tenant(db_session, settings):
    owner, other = await create_tenant(db_session), await create_tenant(db_session)
    row, _ = await create_api_key(db_session, owner)
    keys = ApiKeyService(db_session, settings)
    with pytest.raises(ApiKeyNotFound):
        await keys.revoke_key(other.id, row.id, actor="t")
    assert [k.id for k in await keys.list_keys(other.id)] == []
    assert [k.id for k in await keys.list_keys(owner.id)] == [row.id]


async def test_key_creation_validates_tenant_and_expiry(db_session, settings):
    keys = ApiKeyService(db_session, settings)
    with pytest.raises(TenantNotFound):
        await keys.create_key(10**12, ApiKeyCreate(), actor="t")
    tenant = await create_tenant(db_session)
    with pytest.raises(InvalidTenantData, match="future"):
        await keys.create_key(tenant.id, ApiKeyCreate(expires_at=datetime(2000, 1, 1, tzinfo=UTC)), actor="t")
    with pytest.raises(ValidationError, match="timezone"):
        ApiKeyCreate(expires_at=datetime(2100, 1, 1))
