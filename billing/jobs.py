"""The periodic billing jobs behind the Celery tasks of ``billing.tasks`` (and the CLI), as plain async
functions over a ``Database`` and a Redis client, each one or more units of work.

- ``export_stripe``: plan + send meter events for every attached tenant (``billing.stripe_export``).
  The beat passes ``until`` = the start of the hour that ended ``stripe_export_lag_s`` ago; the CLI may
  pass now (the running hour, partial).
- ``reconcile_rollups_job``: proves the last ``rollup_reconcile_window_h`` hours of rollups equal to the
  ledger (one consistent snapshot, ingestion not blocked) and repairs any difference (under the lock).
- ``maintain_partitions``: the ledger's monthly partitions, three months ahead.
- ``check_budgets_job``: budget alerts, then their webhooks (after the commit).
- ``enforce_payment_grace_job``: billing suspensions whose grace period ended; gateways are told after
  the commit.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from redis.asyncio import Redis
from redis.exceptions import RedisError

from billing.alerts import check_budgets, deliver_alert_webhooks
from billing.partitions import ensure_usage_partitions
from billing.rollups import find_rollup_mismatches, hour_of, reconcile_rollups
from billing.stripe_billing import open_stripe
from billing.stripe_export import ExportResult, export_to_stripe
from billing.suspension import enforce_payment_grace, publish_tenant_changed
from tollgate.db import Database
from tollgate.settings import Settings

logger = logging.getLogger("tollgate.billing")


def export_horizon(settings: Settings, now: datetime | None = None) -> datetime:
    """The end of what the beat exports: whole hours that ended at least ``stripe_export_lag_s`` ago."""
    now = now or datetime.now(UTC)
    return hour_of(now - timedelta(seconds=settings.stripe_export_lag_s))


async def export_stripe(db: Database, settings: Settings, *,
                        until: datetime | None = None) -> ExportResult | None:
    """None when Stripe is not configured (no API key): nothing is planned, nothing is lost."""
    if settings.stripe_api_key is None:
        logger.debug("stripe export skipped: TOLLGATE_STRIPE_API_KEY is not set")
        return None
    async with open_stripe(settings) as client:
        result = await export_to_stripe(db.session, client, until=until or export_horizon(settings))
    if result.failed:
        logger.warning("stripe export: %d sent, %d left pending: %s", result.sent, result.failed,
                       "; ".join(result.errors[:5]))
    return result


async def reconcile_rollups_job(db: Database, settings: Settings, *,
                                now: datetime | None = None) -> dict[str, int]:
    """Check without blocking ingestion; only if something differs, repair those tenants' hours under
    the exclusive lock (which re-checks them against the ledger as committed by then)."""
    now = now or datetime.now(UTC)
    start = now - timedelta(hours=settings.rollup_reconcile_window_h)
    async with db.session() as session:
        await session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
        mismatches = await find_rollup_mismatches(session, start, now)
    if not mismatches:
        return {"mismatched": 0, "repaired": 0, "removed": 0}
    hours = [key[1] for key in mismatches]
    async with db.session() as session:
        result = await reconcile_rollups(session, min(hours), max(hours) + timedelta(hours=1),
                                         tenant_ids=sorted({key[0] for key in mismatches}))
    if result.repaired or result.removed:
        logger.warning("rollups repaired: %d bucket(s) rewritten, %d removed", len(result.repaired),
                       len(result.removed))
    return {"mismatched": len(mismatches), "repaired": len(result.repaired), "removed": len(result.removed)}


async def maintain_partitions(db: Database) -> list[str]:
    async with db.session() as session:
        return await ensure_usage_partitions(session)


async def check_budgets_job(db: Database, redis: Redis, settings: Settings) -> dict[str, Any]:
    async with db.session() as session:
        created = [(a.tenant_id, a.threshold_percent) for a in await check_budgets(session, redis)]
    async with httpx.AsyncClient(timeout=settings.alert_webhook_timeout_s) as http:
        delivery = await deliver_alert_webhooks(db.session, http)
    return {"created": created, "delivered": delivery.delivered, "retrying": delivery.retrying,
            "failed": delivery.failed}


async def enforce_payment_grace_job(db: Database, redis: Redis, settings: Settings) -> list[int]:
    async with db.session() as session:
        suspended = await enforce_payment_grace(session, now=datetime.now(UTC),
                                                grace_s=settings.payment_failed_grace_s)
    if suspended:
        try:
            await publish_tenant_changed(redis, suspended)
        except RedisError as exc:
            logger.warning("suspension committed but not published (key cache TTL applies): %s", exc)
    return suspended
