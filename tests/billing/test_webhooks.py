"""``POST /webhooks/stripe`` through the gateway app (extension ``billing.webhooks``) on real Postgres and
Redis: signatures verified by the stripe SDK, replays ignored, unpaid invoices suspend after the grace
period, paid invoices lift a billing suspension only, and gateways are told."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import httpx
import orjson
from sqlalchemy import func, select

import billing.webhooks
from billing.suspension import enforce_payment_grace
from gateway.app import create_app
from tests.billing.fake_stripe import sign_webhook
from tests.billing.invalidations import next_invalidation
from tests.factories import create_tenant
from tollgate.db import Database
from tollgate.models import StripeEvent, Tenant
from tollgate.redis import INVALIDATE_CHANNEL
from tollgate.settings import Settings

SECRET = "whsec_test_tollgate"


@asynccontextmanager
async def webhook_app(database_url: str, redis_url: str, grace_s: float) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(environment="test", database_url=database_url, redis_url=redis_url,
                        stripe_webhook_secret=SECRET, payment_failed_grace_s=grace_s, database_pool_size=2)
    app = create_app(settings, (billing.webhooks,))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            yield client


def invoice_event(kind: str, customer: str, *, event_id: str | None = None,
                  created: int | None = None) -> dict[str, Any]:
    return {"id": event_id or f"evt_{uuid.uuid4().hex}", "object": "event", "type": kind,
            "created": created or int(time.time()), "api_version": "2026-10-28.endive", "livemode": False,
            "data": {"object": {"id": f"in_{uuid.uuid4().hex[:12]}", "object": "invoice",
                                "customer": customer,
                                "status": "open" if kind.endswith("failed") else "paid"}}}


async def post(client: httpx.AsyncClient, event: dict[str, Any], *, secret: str = SECRET,
               timestamp: int | None = None) -> httpx.Response:
    body = orjson.dumps(event)
    return await client.post("/webhooks/stripe", content=body, headers={
        "content-type": "application/json", "stripe-signature": sign_webhook(body, secret, timestamp)})


async def tenant_row(db: Database, tenant_id: int) -> Tenant:
    async with db.session() as session:
        return await session.get(Tenant, tenant_id)


async def new_tenant(db: Database, **columns: Any) -> Tenant:
    async with db.session() as session:
        return await create_tenant(session, stripe_customer_id=f"cus_{uuid.uuid4().hex[:12]}", **columns)


async def test_bad_signatures_and_stale_timestamps_are_refused(new_database, database, redis_url) -> None:
    tenant = await new_tenant(database)
    event = invoice_event("invoice.payment_failed", tenant.stripe_customer_id)
    async with webhook_app(new_database, redis_url, grace_s=0) as client:
        assert (await post(client, event, secret="whsec_wrong")).status_code == 400
        # Signed just past the tolerance: stale however long the request then takes to arrive.
        signed_at = int(time.time()) - billing.webhooks.WEBHOOK_TOLERANCE_S - 1
        stale = await post(client, event, timestamp=signed_at)
        assert stale.status_code == 400
        unsigned = await client.post("/webhooks/stripe", content=orjson.dumps(event))
        assert unsigned.status_code == 400
        assert unsigned.json()["error"]["type"] == "invalid_request_error"
        tampered = orjson.dumps(event)
        header = sign_webhook(tampered, SECRET)
        changed = tampered.replace(b"invoice.payment_failed", b"invoice.paid")
        response = await client.post("/webhooks/stripe", content=changed,
                                     headers={"stripe-signature": header})
        assert response.status_code == 400
    async with database.session() as session:
        assert await session.scalar(select(func.count()).select_from(StripeEvent)) == 0
    row = await tenant_row(database, tenant.id)
    assert (row.status, row.payment_failed_at) == ("active", None)


async def test_payment_failed_suspends_after_the_grace_period_and_paid_reactivates(
        new_database, database, redis_url, redis_client) -> None:
    tenant = await new_tenant(database)
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(INVALIDATE_CHANNEL)
    failed = invoice_event("invoice.payment_failed", tenant.stripe_customer_id)
    async with webhook_app(new_database, redis_url, grace_s=3600) as client:
        response = await post(client, failed)
        assert response.status_code == 200 and response.json() == {"received": True, "duplicate": False}
        row = await tenant_row(database, tenant.id)
        assert row.status == "active" and row.payment_failed_at is not None  # still within the grace

        async with database.session() as session:  # the beat task, once the grace period is over
            later = row.payment_failed_at + timedelta(seconds=3600)
            assert await enforce_payment_grace(session, now=later - timedelta(seconds=1), grace_s=3600) == []
            assert await enforce_payment_grace(session, now=later, grace_s=3600) == [tenant.id]
        row = await tenant_row(database, tenant.id)
        assert (row.status, row.suspended_reason) == ("suspended", "billing")

        replay = await post(client, failed)  # Stripe redelivers the same event
        assert replay.status_code == 200 and replay.json()["duplicate"] is True
        assert (await tenant_row(database, tenant.id)).payment_failed_at == row.payment_failed_at

        paid = invoice_event("invoice.paid", tenant.stripe_customer_id)
        assert (await post(client, paid)).status_code == 200
        row = await tenant_row(database, tenant.id)
        assert (row.status, row.suspended_reason, row.payment_failed_at) == ("active", None, None)
        await next_invalidation(pubsub, {"tenant_id": tenant.id})

        # A replay of the old failure after the payment changes nothing either.
        assert (await post(client, failed)).json()["duplicate"] is True
        assert (await tenant_row(database, tenant.id)).status == "active"
    await pubsub.aclose()
    async with database.session() as session:
        assert await session.scalar(select(func.count()).select_from(StripeEvent)) == 2


async def test_no_grace_suspends_at_once_and_paid_never_lifts_an_admin_suspension(
        new_database, database, redis_url) -> None:
    tenant = await new_tenant(database)
    admin_suspended = await new_tenant(database, status="suspended", suspended_reason="admin")
    async with webhook_app(new_database, redis_url, grace_s=0) as client:
        await post(client, invoice_event("invoice.payment_failed", tenant.stripe_customer_id))
        row = await tenant_row(database, tenant.id)
        assert (row.status, row.suspended_reason) == ("suspended", "billing")

        for kind in ("invoice.payment_failed", "invoice.paid"):
            response = await post(client, invoice_event(kind, admin_suspended.stripe_customer_id))
            assert response.status_code == 200
        row = await tenant_row(database, admin_suspended.id)
        assert (row.status, row.suspended_reason) == ("suspended", "admin")

        unknown = await post(client, invoice_event("invoice.paid", "cus_nobody"))
        assert unknown.status_code == 200
