"""Celery tasks of billing, scheduled by beat (``beat_schedule``; ``tollgate.worker`` includes this
module and merges the schedule):

- ``billing.flush_usage`` every ``usage_flush_interval_s``: outbox stream → ``usage_events``
  (``billing.ledger.UsageFlusher``). Entries expire from the queue after one interval, so a backlog of
  flush tasks never piles up while a worker is busy; any number may run at once safely.
- ``billing.reconcile_spend`` every ``RECONCILE_INTERVAL_S``: raises each tenant's month-to-date spend
  counter in Redis to the ledger's sum (repairs a Redis that lost writes).

Each run opens its own database engine and Redis client inside ``asyncio.run`` and disposes them, so a
task never shares connections across event loops or forked worker processes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any

from celery import shared_task

from billing.ledger import LedgerUnavailable, UsageFlusher
from billing.service import reconcile_month_spend
from tollgate.db import Database
from tollgate.redis import create_redis
from tollgate.settings import Settings, get_settings

logger = logging.getLogger("tollgate.billing")

RECONCILE_INTERVAL_S = 300.0
MAX_BATCHES_PER_RUN = 50
CONSUMER_IDLE_FORGET_MS = 24 * 3600 * 1000


def claim_idle_ms(settings: Settings) -> int:
    """How long another consumer's pending entries wait before a flusher takes them over: 30 flush
    intervals (30 s by default), far above one batch's insert time."""
    return max(100, int(settings.usage_flush_interval_s * 30_000))


def consumer_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


async def flush_usage_once(settings: Settings, *, max_batches: int = MAX_BATCHES_PER_RUN) -> dict[str, int]:
    db = Database.from_settings(settings)
    redis = create_redis(settings)
    try:
        flusher = UsageFlusher(redis, db.session, consumer=consumer_name(),
                               batch_size=settings.usage_flush_batch, claim_idle_ms=claim_idle_ms(settings))
        try:
            result = await flusher.flush(max_batches=max_batches)
        except LedgerUnavailable as exc:
            logger.warning("usage flush postponed, records stay in the outbox: %s", exc)
            return {"entries": 0, "inserted": 0, "duplicates": 0, "dead": 0, "postponed": 1}
        await flusher.forget_idle_consumers(CONSUMER_IDLE_FORGET_MS)
        return {"entries": result.entries, "inserted": result.inserted, "duplicates": result.duplicates,
                "dead": result.dead, "postponed": 0}
    finally:
        await redis.aclose()
        await db.dispose()


async def reconcile_spend_once(settings: Settings) -> int:
    db = Database.from_settings(settings)
    redis = create_redis(settings)
    try:
        async with db.session() as session:
            return await reconcile_month_spend(session, redis)
    finally:
        await redis.aclose()
        await db.dispose()


@shared_task(name="billing.flush_usage", ignore_result=True)
def flush_usage() -> dict[str, int]:
    return asyncio.run(flush_usage_once(get_settings()))


@shared_task(name="billing.reconcile_spend", ignore_result=True)
def reconcile_spend() -> int:
    return asyncio.run(reconcile_spend_once(get_settings()))


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """Entries for ``celery_app.conf.beat_schedule``."""
    interval = settings.usage_flush_interval_s
    return {
        "billing.flush_usage": {"task": "billing.flush_usage", "schedule": interval,
                                "options": {"expires": max(1.0, interval)}},
        "billing.reconcile_spend": {"task": "billing.reconcile_spend", "schedule": RECONCILE_INTERVAL_S,
                                    "options": {"expires": RECONCILE_INTERVAL_S}},
    }
