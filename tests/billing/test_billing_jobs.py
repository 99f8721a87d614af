"""The periodic billing jobs (``billing.jobs``) and their Celery tasks on a committed database: the beat's
Stripe export horizon leaves the running hour alone, payment-grace suspensions reach the gateways, budget
checks and rollup reconciles run in a worker process runtime, partitions exist ahead."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from billing import jobs, tasks
from billing.rollups import hour_of
from billing.spend import spend_key
from billing.stripe_billing import attach_tenant, make_client, setup_stripe
from tests.billing.fake_stripe import FakeStripe
from tests.billing.invalidations import next_invalidation
from tests.factories import create_tenant, create_usage_event
from tollgate.db import Database
from tollgate.models import BudgetAlert, Tenant
from tollgate.redis import INVALIDATE_CHANNEL, create_redis
from tollgate.settings import Settings, get_settings


async def test_beat_export_sends_whole_hours_that_ended_the_lag_ago(database, new_database) -> None:
    fake = FakeStripe().start()
    try:
        assert await jobs.export_stripe(database, Settings(environment="test")) is None  # no API key: skipped
        settings = Settings(environment="test", stripe_api_key="sk_test_jobs", stripe_api_base=fake.url,
                            stripe_export_lag_s=0, stripe_max_network_retries=0)
        client = make_client(settings)
        now = datetime.now(UTC)
        async with database.session() as session:
            await setup_stripe(session, client, settings)
            tenant = await create_tenant(session)
            await attach_tenant(session, client, tenant.name, now=now - timedelta(hours=3))
            await create_usage_event(session, tenant, cost_pico_usd=7_000_000,
                                     created_at=hour_of(now) - timedelta(minutes=30))
            await create_usage_event(session, tenant, cost_pico_usd=9_000_000, created_at=now)
        result = await jobs.export_stripe(database, settings)
        assert result is not None and (result.planned, result.sent) == (1, 1)
        assert [e["payload"]["value"] for e in fake.meter_events] == ["7"]  # the running hour waits
        assert jobs.export_horizon(settings.model_copy(update={"stripe_export_lag_s": 3600}),
                                   now) == hour_of(now) - timedelta(hours=1)
    finally:
        fake.stop()


async def test_payment_grace_job_suspends_and_tells_the_gateways(database, redis_client) -> None:
    async with database.session() as session:
        late = await create_tenant(session, payment_failed_at=datetime.now(UTC) - timedelta(days=4))
        recent = await create_tenant(session, payment_failed_at=datetime.now(UTC) - timedelta(hours=1))
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(INVALIDATE_CHANNEL)
    settings = Settings(environment="test", payment_failed_grace_s=3 * 24 * 3600)
    assert await jobs.enforce_payment_grace_job(database, redis_client, settings) == [late.id]
    await next_invalidation(pubsub, {"tenant_id": late.id})
    await pubsub.aclose()
    async with database.session() as session:
        assert (await session.get(Tenant, late.id)).suspended_reason == "billing"
        assert (await session.get(Tenant, recent.id)).status == "active"


def test_celery_tasks_for_budgets_rollups_and_partitions(new_database, service_settings, monkeypatch) -> None:
    monkeypatch.setenv("TOLLGATE_DATABASE_URL", new_database)
    get_settings.cache_clear()

    async def seed() -> int:
        db = Database(new_database, pool_size=1)
        redis = create_redis(service_settings)
        try:
            async with db.session() as session:
                tenant = await create_tenant(session, monthly_budget_pico_usd=1_000)
                await create_usage_event(session, tenant, cost_pico_usd=900, created_at=datetime.now(UTC))
            # The worker's Redis database is shared with tests on other databases, whose tenant may have
            # had this id: its spend counter (which check_budgets reads beside the ledger) starts empty.
            await redis.delete(spend_key(tenant.id))
            return tenant.id
        finally:
            await redis.aclose()
            await db.dispose()

    async def alerts(tenant_id: int) -> list[tuple[int, str]]:
        db = Database(new_database, pool_size=1)
        try:
            async with db.session() as session:
                rows = await session.execute(select(BudgetAlert.threshold_percent, BudgetAlert.webhook_status)
                                             .where(BudgetAlert.tenant_id == tenant_id))
                return sorted((threshold, status) for threshold, status in rows.all())
        finally:
            await db.dispose()

    tenant_id = asyncio.run(seed())
    try:
        result = tasks.check_budgets_task.apply().get()
        assert (tenant_id, 80) in result["created"] and result["delivered"] == 0
        assert asyncio.run(alerts(tenant_id)) == [(80, "none")]
        # The usage was written straight into the ledger (no flusher): the reconcile adds its bucket.
        assert tasks.reconcile_rollups_task.apply().get()["repaired"] == 1
        assert tasks.reconcile_rollups_task.apply().get()["repaired"] == 0
        assert tasks.maintain_partitions_task.apply().get() == []  # the migration made them ahead
        assert tasks.export_stripe_task.apply().get() is None  # no Stripe key in this environment
    finally:
        tasks.shutdown_process_runtime()
