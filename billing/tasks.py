"""Celery tasks of billing, scheduled by beat (``beat_schedule``; ``tollgate.worker`` lists this module
in ``TASK_MODULES`` and merges the schedule):

- ``billing.flush_usage`` every ``usage_flush_interval_s``: outbox stream → ``usage_events``
  (``billing.ledger.UsageFlusher``). Entries expire from the queue after one interval, so flush tasks
  never pile up behind a busy worker; any number may run at once safely (the ledger is idempotent).
- ``billing.reconcile_spend`` every ``RECONCILE_INTERVAL_S``: raises each tenant's month-to-date spend
  counter in Redis to the ledger's sum (repairs a Redis that lost writes).
- ``billing.export_stripe`` every ``stripe_export_interval_s``; ``billing.reconcile_rollups`` every
  ``rollup_reconcile_interval_s``; ``billing.maintain_partitions`` daily; ``billing.check_budgets`` and
  ``billing.enforce_payment_grace`` every ``budget_alert_interval_s`` (``billing.jobs``). Each is safe to
  run concurrently with itself (outbox rows, advisory and row locks), so an expired or repeated run
  never doubles anything.

Each worker process keeps one event loop, one database engine and one Redis client for its tasks
(``tollgate.process_runtime``), created lazily in the process that runs the task (never before Celery
forks), so a flush every second does not open new Postgres and Redis connections every second.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from celery import shared_task
from redis.asyncio import Redis

from billing import jobs
from billing.ledger import LedgerUnavailable, SessionFactory, UsageFlusher
from billing.service import reconcile_month_spend
from tollgate.db import Database
from tollgate.process_runtime import PerProcess, ProcessRuntime
from tollgate.redis import create_redis
from tollgate.settings import Settings
from tollgate.streams import claim_idle_ms, consumer_name

logger = logging.getLogger("tollgate.billing")

RECONCILE_INTERVAL_S = 300.0
PARTITION_INTERVAL_S = 24 * 3600.0
MAX_BATCHES_PER_RUN = 50
CONSUMER_IDLE_FORGET_MS = 24 * 3600 * 1000

T = TypeVar("T")


async def flush_usage(redis: Redis, sessions: SessionFactory, settings: Settings, *,
                      max_batches: int = MAX_BATCHES_PER_RUN) -> dict[str, int]:
    """One flush run: up to ``max_batches`` batches; a Postgres outage postpones it (logged)."""
    flusher = UsageFlusher(redis, sessions, consumer=consumer_name(), batch_size=settings.usage_flush_batch,
                           claim_idle_ms=claim_idle_ms(settings.usage_flush_interval_s))
    try:
        result = await flusher.flush(max_batches=max_batches)
    except LedgerUnavailable as exc:
        logger.warning("usage flush postponed, records stay in the outbox: %s", exc)
        return {"entries": 0, "inserted": 0, "duplicates": 0, "dead": 0, "postponed": 1}
    await flusher.forget_idle_consumers(CONSUMER_IDLE_FORGET_MS)
    return {"entries": result.entries, "inserted": result.inserted, "duplicates": result.duplicates,
            "dead": result.dead, "postponed": 0}


async def reconcile_spend(redis: Redis, db: Database) -> int:
    async with db.session() as session:
        return await reconcile_month_spend(session, redis)


async def flush_usage_once(settings: Settings) -> dict[str, int]:
    """A flush run with connections of its own (the CLI, tests)."""
    db, redis = Database.from_settings(settings), create_redis(settings)
    try:
        return await flush_usage(redis, db.session, settings)
    finally:
        await redis.aclose()
        await db.dispose()


async def reconcile_spend_once(settings: Settings) -> int:
    db, redis = Database.from_settings(settings), create_redis(settings)
    try:
        return await reconcile_spend(redis, db)
    finally:
        await redis.aclose()
        await db.dispose()


class _ProcessRuntime(ProcessRuntime):
    def run(self, job: Callable[[_ProcessRuntime], Awaitable[T]]) -> T:
        return self.loop.run_until_complete(job(self))


_runtime = PerProcess(_ProcessRuntime)


def shutdown_process_runtime() -> None:
    """Close this process's connections and loop (worker shutdown, tests)."""
    _runtime.shutdown()


@shared_task(name="billing.flush_usage", ignore_result=True)
def flush_usage_task() -> dict[str, int]:
    return _runtime.get().run(lambda rt: flush_usage(rt.redis, rt.db.session, rt.settings))


@shared_task(name="billing.reconcile_spend", ignore_result=True)
def reconcile_spend_task() -> int:
    return _runtime.get().run(lambda rt: reconcile_spend(rt.redis, rt.db))


@shared_task(name="billing.export_stripe", ignore_result=True)
def export_stripe_task() -> dict[str, int] | None:
    result = _runtime.get().run(lambda rt: jobs.export_stripe(rt.db, rt.settings))
    if result is None:
        return None
    return {"planned": result.planned, "sent": result.sent, "failed": result.failed}


@shared_task(name="billing.reconcile_rollups", ignore_result=True)
def reconcile_rollups_task() -> dict[str, int]:
    return _runtime.get().run(lambda rt: jobs.reconcile_rollups_job(rt.db, rt.settings))


@shared_task(name="billing.maintain_partitions", ignore_result=True)
def maintain_partitions_task() -> list[str]:
    return _runtime.get().run(lambda rt: jobs.maintain_partitions(rt.db))


@shared_task(name="billing.check_budgets", ignore_result=True)
def check_budgets_task() -> dict[str, Any]:
    return _runtime.get().run(lambda rt: jobs.check_budgets_job(rt.db, rt.redis, rt.settings))


@shared_task(name="billing.enforce_payment_grace", ignore_result=True)
def enforce_payment_grace_task() -> list[int]:
    return _runtime.get().run(lambda rt: jobs.enforce_payment_grace_job(rt.db, rt.redis, rt.settings))


def _every(task: str, seconds: float) -> dict[str, Any]:
    return {"task": task, "schedule": seconds, "options": {"expires": max(1.0, seconds)}}


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """Entries for ``celery_app.conf.beat_schedule``."""
    interval = settings.usage_flush_interval_s
    return {
        "billing.flush_usage": {"task": "billing.flush_usage", "schedule": interval,
                                "options": {"expires": max(1.0, interval)}},
        "billing.reconcile_spend": {"task": "billing.reconcile_spend", "schedule": RECONCILE_INTERVAL_S,
                                    "options": {"expires": RECONCILE_INTERVAL_S}},
    } | {task: _every(task, seconds) for task, seconds in (
        ("billing.export_stripe", settings.stripe_export_interval_s),
        ("billing.reconcile_rollups", settings.rollup_reconcile_interval_s),
        ("billing.maintain_partitions", PARTITION_INTERVAL_S),
        ("billing.check_budgets", settings.budget_alert_interval_s),
        ("billing.enforce_payment_grace", settings.budget_alert_interval_s),
    )}
