"""Monthly budget alerts: at 80 % and 100 % of ``tenants.monthly_budget_pico_usd``.

The cap itself is enforced by admission (``gateway.admission``: month-to-date spend from
``billing.spend`` against the budget, 429 ``insufficient_quota`` once it is spent, until the month
changes or the budget is raised). This module tells people about it:

- ``check_budgets`` (beat, every ``budget_alert_interval_s``): a tenant's month-to-date spend is the
  larger of the Redis counter (admission's view, includes usage still in the outbox) and the ledger.
  Crossing a threshold inserts a ``budget_alerts`` row (``ON CONFLICT DO NOTHING`` on tenant, month,
  threshold), so each alert exists once per month however often or concurrently the check runs. The row
  is the dashboard's flag; with ``tenants.alert_webhook_url`` set it is also the outbox of a webhook.
- ``deliver_alert_webhooks``: after the commit, POSTs pending alerts (row locked ``SKIP LOCKED``) as
  JSON signed like Stripe signs its webhooks: header ``Tollgate-Signature: t=<unix time>,v1=<hex
  HMAC-SHA256(secret, "<t>.<body>")>``, with the tenant's ``alert_webhook_secret``. A 2xx marks it
  delivered; anything else is retried on the next run, ``MAX_WEBHOOK_ATTEMPTS`` times, then ``failed``.
  The body's ``id`` is stable across retries so receivers can deduplicate.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx
import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from billing.ledger import SessionFactory
from billing.repository import spend_by_tenant
from billing.spend import month_bounds, month_field, month_to_date_spend
from billing.statements import usd_exact
from tollgate.models import BudgetAlert, Tenant

logger = logging.getLogger("tollgate.billing.alerts")

THRESHOLDS_PERCENT = (80, 100)
MAX_WEBHOOK_ATTEMPTS = 10
SIGNATURE_HEADER = "Tollgate-Signature"


def new_webhook_secret() -> str:
    return "tgwhsec_" + secrets.token_urlsafe(32)


def sign(body: bytes, secret: str, timestamp: int | None = None) -> str:
    t = int(time.time()) if timestamp is None else timestamp
    mac = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


def verify(body: bytes, header: str, secret: str, *, tolerance_s: int = 300, now: int | None = None) -> bool:
    """What a receiver does (and the tests): check the signature and the timestamp's age."""
    parts = dict(item.split("=", 1) for item in header.split(",") if "=" in item)
    try:
        t = int(parts["t"])
    except (KeyError, ValueError):
        return False
    expected = sign(body, secret, t).split("v1=", 1)[1]
    fresh = abs((int(time.time()) if now is None else now) - t) <= tolerance_s
    return fresh and hmac.compare_digest(expected, parts.get("v1", ""))


async def set_alert_webhook(session: AsyncSession, tenant_id: int, url: str | None) -> str | None:
    """Set (or clear) where a tenant's budget alerts go; returns the signing secret (kept if one exists)."""
    tenant = await session.get(Tenant, tenant_id)
    if tenant is None:
        raise LookupError(f"no tenant {tenant_id}")
    if url is not None and not url.startswith(("https://", "http://")):
        raise ValueError("the alert webhook URL must be http(s)")
    tenant.alert_webhook_url = url
    if url is not None and tenant.alert_webhook_secret is None:
        tenant.alert_webhook_secret = new_webhook_secret()
    await session.flush()
    return tenant.alert_webhook_secret


async def check_budgets(session: AsyncSession, redis: Redis | None, *,
                        now: datetime | None = None) -> list[BudgetAlert]:
    """Create the alerts of every threshold crossed this month; returns the ones created now."""
    month = month_field(now or datetime.now(UTC))
    start, end = month_bounds(month)
    tenants = (await session.scalars(select(Tenant).where(Tenant.monthly_budget_pico_usd > 0)
                                     .order_by(Tenant.id))).all()
    if not tenants:
        return []
    ledger = await spend_by_tenant(session, start, end, [t.id for t in tenants])
    created: list[BudgetAlert] = []
    for tenant in tenants:
        spend = ledger.get(tenant.id, 0)
        if redis is not None:
            try:
                spend = max(spend, await month_to_date_spend(redis, tenant.id, month))
            except RedisError as exc:
                logger.warning("budget check uses the ledger only (Redis: %s)", exc)
                redis = None
        budget = int(tenant.monthly_budget_pico_usd or 0)
        for threshold in THRESHOLDS_PERCENT:
            if spend * 100 < budget * threshold:
                break
            alert_id = await session.scalar(
                insert(BudgetAlert).values(
                    tenant_id=tenant.id, month=month, threshold_percent=threshold, spend_pico_usd=spend,
                    budget_pico_usd=budget, webhook_status="pending" if tenant.alert_webhook_url else "none")
                .on_conflict_do_nothing(index_elements=["tenant_id", "month", "threshold_percent"])
                .returning(BudgetAlert.id))
            if alert_id is not None:
                created.append(await session.get_one(BudgetAlert, alert_id))
    return created


async def alerts_for_month(session: AsyncSession, month: str | None = None, *,
                           tenant_id: int | None = None) -> list[BudgetAlert]:
    """The dashboard's flags: alerts of ``month`` (this one by default), newest first."""
    stmt = select(BudgetAlert).where(BudgetAlert.month == (month or month_field(datetime.now(UTC))))
    if tenant_id is not None:
        stmt = stmt.where(BudgetAlert.tenant_id == tenant_id)
    return list((await session.scalars(stmt.order_by(BudgetAlert.created_at.desc(), BudgetAlert.id))).all())


def alert_body(alert: BudgetAlert) -> bytes:
    return orjson.dumps({
        "id": f"budget_alert_{alert.id}", "object": "event", "type": "budget.threshold_reached",
        "created": int(alert.created_at.timestamp()),
        "data": {"tenant_id": alert.tenant_id, "month": alert.month,
                 "threshold_percent": alert.threshold_percent,
                 "spend_usd": usd_exact(alert.spend_pico_usd), "budget_usd": usd_exact(alert.budget_pico_usd),
                 "spend_pico_usd": alert.spend_pico_usd, "budget_pico_usd": alert.budget_pico_usd,
                 "requests_blocked": alert.threshold_percent >= 100},
    })


@dataclass
class DeliveryResult:
    delivered: int = 0
    retrying: int = 0
    failed: int = 0


async def deliver_alert_webhooks(sessions: SessionFactory, http: httpx.AsyncClient, *,
                                 limit: int = 100) -> DeliveryResult:
    result = DeliveryResult()
    async with sessions() as session:
        pending = (select(BudgetAlert.id).where(BudgetAlert.webhook_status == "pending")
                   .order_by(BudgetAlert.id).limit(limit))
        ids = list((await session.scalars(pending)).all())
    for alert_id in ids:
        async with sessions() as session:
            alert = await session.scalar(select(BudgetAlert).where(BudgetAlert.id == alert_id,
                                                                   BudgetAlert.webhook_status == "pending")
                                         .with_for_update(skip_locked=True))
            if alert is None:
                continue
            tenant = await session.get_one(Tenant, alert.tenant_id)
            if not tenant.alert_webhook_url or not tenant.alert_webhook_secret:
                alert.webhook_status = "none"  # the URL was removed meanwhile
                continue
            body = alert_body(alert)
            alert.attempts += 1
            try:
                response = await http.post(tenant.alert_webhook_url, content=body, headers={
                    "content-type": "application/json",
                    SIGNATURE_HEADER: sign(body, tenant.alert_webhook_secret)})
                error = None if response.is_success else f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"
            if error is None:
                alert.webhook_status, alert.delivered_at = "delivered", datetime.now(UTC)
                alert.last_error = None
                result.delivered += 1
            elif alert.attempts >= MAX_WEBHOOK_ATTEMPTS:
                alert.webhook_status, alert.last_error = "failed", error
                result.failed += 1
            else:
                alert.last_error = error
                result.retrying += 1
    return result
