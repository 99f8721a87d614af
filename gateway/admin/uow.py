"""The admin unit of work: one transaction per request (or dashboard action), then cache invalidations.

Services queue what running gateways must forget (``queue_invalidation(session, tenant_id=3)``,
``key_id="<prefix>"``) on the session itself (``session.info``); ``admin_unit_of_work`` commits and only
then publishes the queued messages on ``tollgate:invalidate`` through ``tollgate.redis.publish_invalidation``
(the same channel and format the gateways listen to). So a rolled-back change is never announced, and a
gateway that reloads on the message sees the committed row.

Invariants:
- Services never commit and never publish; whoever owns the unit of work does both, in that order.
- The FastAPI dependency (``AdminSession``) has ``scope="function"``: the commit and the publish happen
  before the response is sent, so a client that got 200 for a revocation can rely on it, and a failed
  commit is an error response, not a silent loss.
- An extra invalidation is harmless (a gateway reloads a row); a missing one is not. A publish that
  fails after a successful commit is logged, not raised: the change stands and gateway caches still
  expire after ``key_cache_ttl_s``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import orjson
from fastapi import Depends, Request
from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy.ext.asyncio import AsyncSession

from tollgate.db import Database
from tollgate.redis import publish_invalidation

logger = logging.getLogger("tollgate.gateway.admin")

_PENDING = "tollgate.pending_invalidations"


def queue_invalidation(session: AsyncSession, **what: int | str) -> None:
    """Announce ``what`` (``tenant_id=`` / ``key_id=`` / ``api_key_id=``) after this session commits."""
    pending: dict[bytes, dict[str, Any]] = session.info.setdefault(_PENDING, {})
    pending.setdefault(orjson.dumps(what, option=orjson.OPT_SORT_KEYS), dict(what))


def pending_invalidations(session: AsyncSession) -> list[dict[str, Any]]:
    return list(session.info.get(_PENDING, {}).values())


async def publish_invalidations(redis: Redis, messages: list[dict[str, Any]]) -> None:
    for message in messages:
        try:
            await publish_invalidation(redis, **message)
        except (RedisError, OSError) as exc:
            logger.warning("committed, but could not publish invalidation %s: %s", message, exc)


@asynccontextmanager
async def admin_unit_of_work(db: Database, redis: Redis) -> AsyncIterator[AsyncSession]:
    """A session that commits when the block exits normally (rolls back otherwise), then publishes the
    invalidations its services queued. The dashboard and the CLI use it as the admin API does."""
    async with db.session() as session:
        yield session
        messages = pending_invalidations(session)
    await publish_invalidations(redis, messages)


async def _request_unit_of_work(request: Request) -> AsyncIterator[AsyncSession]:
    async with admin_unit_of_work(request.app.state.db, request.app.state.redis) as session:
        yield session


AdminSession = Annotated[AsyncSession, Depends(_request_unit_of_work, scope="function")]
