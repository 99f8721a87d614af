"""The shared fixtures behave as documented: rolled-back transactions, per-worker databases and Redis."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select, text

from tests.factories import create_api_key, create_price, create_tenant, create_usage_event
from tollgate.models import Tenant
from tollgate.settings import get_settings

FIXED_NAME = "fixture-isolation-tenant"


@pytest.mark.parametrize("attempt", [1, 2])
async def test_each_test_runs_in_a_rolled_back_transaction(db_session, attempt):
    # The same unique name is inserted by both parametrized runs: the first must have been rolled back.
    assert await db_session.scalar(select(func.count()).where(Tenant.name == FIXED_NAME)) == 0
    await create_tenant(db_session, name=FIXED_NAME)
    await db_session.commit()  # only releases a savepoint
    assert await db_session.scalar(select(func.count()).where(Tenant.name == FIXED_NAME)) == 1


async def test_worker_database_is_migrated(db_session, database_url):
    assert database_url.rsplit("/", 1)[1].startswith("tollgate_test_")
    version = await db_session.scalar(text("SELECT version_num FROM alembic_version"))
    assert version


async def test_factories_build_a_consistent_ledger_row(db_session):
    tenant = await create_tenant(db_session, tpm_limit=1000)
    key, full_key = await create_api_key(db_session, tenant)
    price = await create_price(db_session, model="m", input=3_000_001)
    event = await create_usage_event(db_session, tenant, api_key=key, prompt_tokens=10, cached_tokens=4)
    assert full_key.startswith("sk-tg-") and key.prefix in full_key
    assert price.batch_input == 1_500_000 and price.cached_input == 300_000
    assert event.api_key_id == key.id and event.cost_pico_usd > 0


async def test_redis_client_is_flushed_per_test(redis_client):
    assert await redis_client.dbsize() == 0
    await redis_client.set("tollgate:test:fixture", "1")


@pytest.mark.settings(rate_limit_window_s=2.5, gateway_workers=3)
def test_settings_marker_overrides_fields(settings):
    assert settings.environment == "test"
    assert settings.rate_limit_window_s == 2.5 and settings.gateway_workers == 3
    assert get_settings() is settings


def test_service_settings_point_at_the_worker_servers(service_settings, database_url, redis_url):
    assert service_settings.database_url == database_url
    assert service_settings.redis_url == redis_url
