"""Counts of refused requests per tenant, reason and UTC hour, for the dashboard's "rejections by reason".

The gateway refuses a request before any engine work with a rate limit, the concurrency cap, the monthly
budget, a suspension, SLO shedding or "no replica". None of these reach the ledger (nothing is billed),
so ``count_rejections`` — wrapped around shedding and admission in ``Generation.start`` — adds one to a
Redis hash per UTC hour::

    tollgate:rejections:<hour start, epoch seconds>   field "<tenant_id>:<reason>"   value: count

Reasons: ``rpm`` (requests per minute, including a zero limit), ``tpm`` (tokens per minute, including a
request larger than the bucket), ``concurrency``, ``budget`` (``insufficient_quota``: monthly budget or a
billing suspension), ``suspended`` (admin suspension), ``overloaded`` (SLO shedding), ``unavailable``
(no healthy replica, admission store down). Only the interactive API is counted: the batch tier defers
lines instead of refusing them.

Invariants:
- Counting never changes the answer: a Redis failure while counting is logged and swallowed, and the
  original error is re-raised unchanged. It costs one pipelined round trip, on the refusal path only.
- Buckets expire ``RETENTION_S`` after their hour (40 days: the current and the previous month stay
  queryable); ``rejection_counts`` reads whole hours in ``[start, end)``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.errors import GatewayError
from gateway.metrics import observe_rejection

logger = logging.getLogger("tollgate.gateway.rejections")

KEY_PREFIX = "tollgate:rejections:"
RETENTION_S = 40 * 24 * 3600
REASONS = ("rpm", "tpm", "concurrency", "budget", "suspended", "overloaded", "unavailable")
# A query spans at most this many hourly buckets (one HGETALL each, pipelined).
MAX_HOURS = 24 * 93


def rejection_reason(error: GatewayError) -> str | None:
    """The dashboard reason of a refusal raised by shedding or admission, or None if it is not one."""
    if error.code == "insufficient_quota":
        return "budget"
    if error.code == "account_deactivated":
        return "suspended"
    if error.code == "overloaded":
        return "overloaded"
    if error.status == 503:
        return "unavailable"
    if error.status != 429:
        return None
    if error.type == "tokens":
        return "tpm"
    if error.message.startswith("Too many concurrent requests"):
        return "concurrency"
    return "rpm"


def hour_bucket(epoch_s: float) -> int:
    return int(epoch_s // 3600 * 3600)


async def record_rejection(redis: Redis, tenant_id: int, reason: str, *, now: float | None = None) -> None:
    key = f"{KEY_PREFIX}{hour_bucket(time.time() if now is None else now)}"
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hincrby(key, f"{tenant_id}:{reason}", 1)
        pipe.expire(key, RETENTION_S)
        await pipe.execute()


@asynccontextmanager
async def count_rejections(redis: Redis, tenant_id: int, request_class: str,
                           tier: str = "unknown") -> AsyncIterator[None]:
    """Count a refusal raised inside the block (interactive requests only), then re-raise it. The
    Prometheus counter (``gateway.metrics``, by reason and tier) is bumped as well."""
    try:
        yield
    except GatewayError as exc:
        reason = rejection_reason(exc) if request_class == "interactive" else None
        if reason is not None:
            observe_rejection(reason, tier)
            try:
                await record_rejection(redis, tenant_id, reason)
            except (RedisError, OSError) as count_error:
                logger.warning("could not count a %s rejection of tenant %s: %s", reason, tenant_id,
                               count_error)
        raise


@dataclass(frozen=True, slots=True)
class RejectionCount:
    hour: datetime
    tenant_id: int
    reason: str
    count: int


async def rejection_counts(redis: Redis, start: datetime, end: datetime,
                           tenant_id: int | None = None) -> list[RejectionCount]:
    """Counts of the hours starting in ``[start, end)`` (aware datetimes), oldest first; one tenant or all."""
    if start.tzinfo is None or end.tzinfo is None:
        raise ValueError("start and end must be timezone-aware")
    first = hour_bucket(start.timestamp())
    if first < start.timestamp():
        first += 3600
    hours = list(range(first, int(end.timestamp()), 3600))
    if len(hours) > MAX_HOURS:
        raise ValueError(f"at most {MAX_HOURS // 24} days of rejection counts at once")
    if not hours:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for hour in hours:
            pipe.hgetall(f"{KEY_PREFIX}{hour}")
        buckets = await pipe.execute()
    counts = []
    for hour, bucket in zip(hours, buckets, strict=True):
        at = datetime.fromtimestamp(hour, UTC)
        for field, value in sorted((bucket or {}).items()):
            owner, _, reason = (field.decode() if isinstance(field, bytes) else field).partition(":")
            if not owner.isdigit() or (tenant_id is not None and int(owner) != tenant_id):
                continue
            counts.append(RejectionCount(at, int(owner), reason, int(value)))
    return counts
