"""Stripe webhooks at ``POST /webhooks/stripe`` (a ``gateway.app`` extension module: ``router``).

Invariants:
- The body is verified with the stripe SDK (``stripe.Webhook.construct_event``) against
  ``TOLLGATE_STRIPE_WEBHOOK_SECRET`` with a 300 s timestamp tolerance: a wrong signature, a stale or
  future timestamp, or an unparsable body is a 400 and changes nothing. Without a configured secret
  the endpoint answers 503 (Stripe retries), never accepts unsigned events.
- Deduplicated by event id: the id is inserted into ``stripe_events`` (``ON CONFLICT DO NOTHING``) in
  the same transaction as its effects, so a replayed (or concurrently redelivered) event changes
  nothing and still gets a 200, which stops Stripe's retries.
- ``invoice.payment_failed`` records the failure; the tenant is suspended (reason ``billing``) once
  ``payment_failed_grace_s`` has passed since it: here when the grace is already over, otherwise by
  the ``billing.enforce_payment_grace`` beat task. ``invoice.paid`` lifts a ``billing`` suspension
  only, never an admin's. Other event types are recorded and ignored.
- Gateways are told to drop the tenant's cached limits only after the transaction committed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
import stripe
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from billing.suspension import (
    enforce_payment_grace,
    lift_billing_suspension,
    publish_tenant_changed,
    record_payment_failed,
)
from tollgate.models import StripeEvent, Tenant
from tollgate.settings import Settings

logger = logging.getLogger("tollgate.billing.webhooks")

WEBHOOK_TOLERANCE_S = 300

router = APIRouter(tags=["stripe"])


@dataclass
class WebhookOutcome:
    duplicate: bool = False
    changed_tenants: list[int] = field(default_factory=list)


def _error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                        status_code=status)


async def _tenant_for_customer(session: AsyncSession, customer: Any) -> Tenant | None:
    customer_id = customer.get("id") if isinstance(customer, dict) else customer
    if not isinstance(customer_id, str):
        return None
    return await session.scalar(select(Tenant).where(Tenant.stripe_customer_id == customer_id)
                                .with_for_update())


async def handle_event(session: AsyncSession, event: dict[str, Any], settings: Settings, *,
                       now: datetime | None = None) -> WebhookOutcome:
    """Apply one verified event (the caller commits)."""
    now = now or datetime.now(UTC)
    created = datetime.fromtimestamp(int(event.get("created") or now.timestamp()), UTC)
    claimed = await session.scalar(
        insert(StripeEvent).values(id=event["id"], type=str(event.get("type", "")), event_created_at=created)
        .on_conflict_do_nothing(index_elements=["id"]).returning(StripeEvent.id))
    if claimed is None:
        return WebhookOutcome(duplicate=True)
    outcome = WebhookOutcome()
    kind = event.get("type")
    if kind not in ("invoice.payment_failed", "invoice.paid"):
        return outcome
    invoice = (event.get("data") or {}).get("object") or {}
    tenant = await _tenant_for_customer(session, invoice.get("customer"))
    if tenant is None:
        logger.warning("stripe event %s (%s) for unknown customer %r", event["id"], kind,
                       invoice.get("customer"))
        return outcome
    if kind == "invoice.payment_failed":
        await record_payment_failed(session, tenant, created)
        outcome.changed_tenants = await enforce_payment_grace(
            session, now=now, grace_s=settings.payment_failed_grace_s, tenant_ids=[tenant.id])
    elif await lift_billing_suspension(session, tenant, created):
        outcome.changed_tenants = [tenant.id]
    return outcome


@router.post("/webhooks/stripe", include_in_schema=False)
async def stripe_webhook(request: Request) -> JSONResponse:
    settings: Settings = request.app.state.settings
    if settings.stripe_webhook_secret is None:
        return _error(503, "Stripe webhooks are not configured (TOLLGATE_STRIPE_WEBHOOK_SECRET).")
    payload = await request.body()
    try:
        stripe.Webhook.construct_event(payload, request.headers.get("stripe-signature"),
                                       settings.stripe_webhook_secret.get_secret_value(),
                                       tolerance=WEBHOOK_TOLERANCE_S)
        event = orjson.loads(payload)
    except stripe.SignatureVerificationError as exc:
        return _error(400, f"Invalid Stripe signature: {exc.user_message or exc}")
    except ValueError:
        return _error(400, "Invalid webhook payload.")
    if not isinstance(event, dict) or not isinstance(event.get("id"), str):
        return _error(400, "Invalid webhook payload: no event id.")
    async with request.app.state.db.session() as session:
        outcome = await handle_event(session, event, settings)
    if outcome.changed_tenants:
        try:
            await publish_tenant_changed(request.app.state.redis, outcome.changed_tenants)
        except RedisError as exc:  # committed already; cached limits expire after key_cache_ttl_s
            logger.warning("tenant change not published (gateways see it within the key cache TTL): %s", exc)
    return JSONResponse({"received": True, "duplicate": outcome.duplicate})
