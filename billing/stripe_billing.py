"""Stripe: the client, one-time provisioning (meter, product, metered price) and attaching tenants.

The official ``stripe`` SDK is used with its async methods over httpx. ``TOLLGATE_STRIPE_API_BASE``
points it elsewhere than ``https://api.stripe.com`` (tests run a local server that behaves like Stripe).

Invariants:
- Every create call carries an ``Idempotency-Key`` derived from what it creates (``tollgate-meter-v1``,
  ``tollgate-customer-<tenant id>``, …), so a crash between Stripe's answer and our commit followed by a
  rerun gets the same object back instead of a second one (Stripe keeps keys 24 hours; beyond that the
  meter is found again by its event name).
- Provisioning happens once: ``stripe_provisioning`` holds the one meter/product/price; rerunning
  ``setup_stripe`` returns it. Stripe is called before our transaction commits, and only creates.
- The meter sums integer micro-USD (``value``); the price charges 0.0001 cent (one micro-USD) per unit.
- A tenant is exported only once attached: ``attach_tenant`` stores the customer and subscription on
  the tenant and creates its ``stripe_export_state`` starting at the current hour.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

import stripe
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from billing.rollups import hour_of
from tollgate.models import StripeExportState, StripeProvisioning, Tenant
from tollgate.settings import Settings

METER_DISPLAY_NAME = "Tollgate usage (micro-USD)"
PRODUCT_NAME = "Tollgate API usage"
# One meter unit is one micro-USD = 0.0001 US cent.
UNIT_AMOUNT_DECIMAL_CENTS = Decimal("0.0001")


class StripeNotConfigured(RuntimeError):
    """TOLLGATE_STRIPE_API_KEY is not set, or ``setup-stripe`` has not run."""


class TenantNotFound(LookupError):
    pass


def make_client(settings: Settings, http_client: stripe.HTTPXClient | None = None) -> stripe.StripeClient:
    if settings.stripe_api_key is None:
        raise StripeNotConfigured("TOLLGATE_STRIPE_API_KEY is not set")
    base = settings.stripe_api_base
    return stripe.StripeClient(settings.stripe_api_key.get_secret_value(),
                               base_addresses={"api": base.rstrip("/")} if base else {},
                               http_client=http_client or stripe.HTTPXClient(),
                               max_network_retries=settings.stripe_max_network_retries)


@asynccontextmanager
async def open_stripe(settings: Settings) -> AsyncIterator[stripe.StripeClient]:
    """A client whose HTTP connections are closed when the block ends (CLI runs, beat tasks)."""
    http = stripe.HTTPXClient()
    client = make_client(settings, http)
    try:
        yield client
    finally:
        await http.close_async()
        http.close()


@dataclass(frozen=True)
class Provisioning:
    meter_event_name: str
    meter_id: str
    product_id: str
    price_id: str
    created: bool


async def get_provisioning(session: AsyncSession) -> StripeProvisioning | None:
    return await session.get(StripeProvisioning, 1)


async def setup_stripe(session: AsyncSession, client: stripe.StripeClient,
                       settings: Settings) -> Provisioning:
    """Create the meter, product and price once; later calls return what exists."""
    existing = await get_provisioning(session)
    if existing is not None:
        return Provisioning(existing.meter_event_name, existing.meter_id, existing.product_id,
                            existing.price_id, created=False)
    event_name = settings.stripe_meter_event_name
    meters = await client.v1.billing.meters.list_async({"status": "active", "limit": 100})
    meter = next((m for m in meters.data if m.event_name == event_name), None)
    if meter is None:
        meter = await client.v1.billing.meters.create_async(
            {"display_name": METER_DISPLAY_NAME, "event_name": event_name,
             "default_aggregation": {"formula": "sum"},
             "customer_mapping": {"type": "by_id", "event_payload_key": "stripe_customer_id"},
             "value_settings": {"event_payload_key": "value"}},
            {"idempotency_key": f"tollgate-meter-{event_name}"})
    product = await client.v1.products.create_async(
        {"name": PRODUCT_NAME, "metadata": {"tollgate": "usage"}},
        {"idempotency_key": f"tollgate-product-{meter.id}"})
    price = await client.v1.prices.create_async(
        {"product": product.id, "currency": "usd", "unit_amount_decimal": UNIT_AMOUNT_DECIMAL_CENTS,
         "recurring": {"interval": "month", "usage_type": "metered", "meter": meter.id},
         "billing_scheme": "per_unit"},
        {"idempotency_key": f"tollgate-price-{meter.id}-{product.id}"})
    session.add(StripeProvisioning(id=1, meter_event_name=event_name, meter_id=meter.id,
                                   product_id=product.id, price_id=price.id))
    await session.flush()
    return Provisioning(event_name, meter.id, product.id, price.id, created=True)


@dataclass(frozen=True)
class Attachment:
    tenant_id: int
    customer_id: str
    subscription_id: str
    created: bool


async def attach_tenant(session: AsyncSession, client: stripe.StripeClient, tenant_ref: str | int, *,
                        now: datetime | None = None) -> Attachment:
    """Create the tenant's Stripe customer and metered subscription (each once) and start exporting
    its usage from the current hour."""
    provisioning = await get_provisioning(session)
    if provisioning is None:
        raise StripeNotConfigured("run `tollgate billing setup-stripe` first")
    tenant = await _tenant(session, tenant_ref)
    created = False
    if tenant.stripe_customer_id is None:
        customer = await client.v1.customers.create_async(
            {"name": tenant.name, "metadata": {"tollgate_tenant_id": str(tenant.id)}},
            {"idempotency_key": f"tollgate-customer-{tenant.id}"})
        tenant.stripe_customer_id = customer.id
        created = True
    if tenant.stripe_subscription_id is None:
        subscription = await client.v1.subscriptions.create_async(
            {"customer": tenant.stripe_customer_id, "items": [{"price": provisioning.price_id}],
             "metadata": {"tollgate_tenant_id": str(tenant.id)}},
            {"idempotency_key": f"tollgate-subscription-{tenant.id}-{tenant.stripe_customer_id}"})
        tenant.stripe_subscription_id = subscription.id
        created = True
    if await session.get(StripeExportState, tenant.id) is None:
        session.add(StripeExportState(tenant_id=tenant.id, since_hour=hour_of(now or datetime.now(UTC)),
                                      covered_pico_usd=Decimal(0), sent_micro_usd=Decimal(0)))
    await session.flush()
    return Attachment(tenant.id, tenant.stripe_customer_id, tenant.stripe_subscription_id or "", created)


async def _tenant(session: AsyncSession, ref: str | int) -> Tenant:
    tenant = None
    if isinstance(ref, int) or ref.isdigit():
        tenant = await session.get(Tenant, int(ref))
    if tenant is None and isinstance(ref, str):
        tenant = await session.scalar(select(Tenant).where(Tenant.name == ref))
    if tenant is None:
        raise TenantNotFound(f"no tenant {ref!r}")
    return tenant
