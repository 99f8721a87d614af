"""Stored responses: written to Redis on the hot path, copied to Postgres by a flusher, read from either.

A response that ends is stored in one Redis round trip (``ResponseStore.put``): its row as JSON under
``tollgate:response:{tenant}:{id}``, expiring when its retention ends, and an entry naming that key on
the stream ``tollgate:responses``. ``responses.flush`` (beat, every ``usage_flush_interval_s``) copies
the rows into ``responses`` (``ResponseFlusher``: a consumer group, as the usage outbox), then lets each
Redis copy live ``RECENT_S`` more, so a conversation's next turn usually reads its history from Redis.

Reads (``get``, ``conversation``) look in Redis first, then in Postgres. ``delete`` leaves a tombstone
(``tollgate:response-deleted:{tenant}:{id}``, kept the retention) before it deletes the Redis copy and
the row: every read honours it, and the flusher deletes again any row it inserted whose tombstone it
sees after its commit, so a response deleted while its row was being flushed never comes back.

Invariants:
- Tenant-scoped everywhere: every key carries the tenant, every query filters by it
  (``gateway.responses.repository``).
- Nothing stored is lost before retention: a stream entry leaves only after its row is committed
  (Postgres down: the entries stay pending, the Redis copies keep serving reads).
- Background responses are not written here: they are rows from the start (``queue_response``), updated
  under their row lock by their worker and by cancel.
- Redis or Postgres unreachable on a read or a delete: a 503 ``store_unavailable`` to retry, never a 500.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError
from sqlalchemy import delete
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.deps import GatewayRuntime
from gateway.errors import ServiceUnavailableError
from gateway.responses.repository import MAX_CHAIN, RESPONSES, ResponseRepository, row_values
from tollgate.models import StoredResponse
from tollgate.streams import StreamGroup

logger = logging.getLogger("tollgate.gateway.responses")

RESPONSE_STREAM = "tollgate:responses"
FLUSH_GROUP = "store"
KEY_FIELD = b"k"
# How long a response's Redis copy outlives the commit of its row (a conversation's next turns).
RECENT_S = 300
_DATETIMES = ("created_at", "expires_at")

SessionFactory = Callable[[], AbstractAsyncContextManager[AsyncSession]]


def response_key(tenant_id: int, response_id: str) -> str:
    return f"tollgate:response:{tenant_id}:{response_id}"


def deleted_key(tenant_id: int, response_id: str) -> str:
    return f"tollgate:response-deleted:{tenant_id}:{response_id}"


def encode_row(row: StoredResponse) -> bytes:
    return orjson.dumps(row_values(row))


def decode_row(raw: bytes | str) -> StoredResponse:
    values = orjson.loads(raw)
    for name in _DATETIMES:
        values[name] = datetime.fromisoformat(values[name])
    return StoredResponse(**values)


def _unavailable(part: str, exc: Exception) -> ServiceUnavailableError:
    logger.warning("the response store's %s is unavailable: %r", part, exc)
    return ServiceUnavailableError("The response store is temporarily unavailable. Please retry.",
                                   code="store_unavailable")


@asynccontextmanager
async def database(runtime: GatewayRuntime, *, write: bool = False) -> AsyncIterator[AsyncSession]:
    """A session on the stored responses' table; the database being unreachable is a 503 to retry,
    never a 500 (the generation endpoints themselves need no database)."""
    try:
        async with runtime.sessions() as session:
            if write:
                async with session.begin():
                    yield session
            else:
                yield session
    except (DBAPIError, OSError) as exc:
        raise _unavailable("database", exc) from None


class ResponseStore:
    """One tenant's stored responses, Redis first."""

    def __init__(self, runtime: GatewayRuntime, tenant_id: int) -> None:
        self.runtime = runtime
        self.tenant_id = tenant_id
        self._retention_ms = max(1, int(runtime.settings.responses_retention_s * 1000))

    async def _redis(self, *commands: tuple[Any, ...]) -> list[Any]:
        try:
            replies = await self.runtime.redis_commands().pipeline(*commands)
        except (RedisError, OSError) as exc:
            raise _unavailable("Redis", exc) from None
        for reply in replies:
            if isinstance(reply, Exception):
                raise _unavailable("Redis", reply)
        return replies

    async def put(self, row: StoredResponse) -> None:
        """Store ``row`` (one round trip; its row reaches Postgres with the next flush)."""
        if row.tenant_id != self.tenant_id:
            raise ValueError("a response must belong to the store's tenant")
        key = response_key(self.tenant_id, row.id)
        await self._redis(("SET", key, encode_row(row), "PX", self._retention_ms),
                          ("XADD", RESPONSE_STREAM, "*", KEY_FIELD, key))

    async def _recent(self, response_id: str) -> tuple[StoredResponse | None, bool]:
        """(The Redis copy or None, whether the response was deleted)."""
        raw, deleted = await self._redis(("GET", response_key(self.tenant_id, response_id)),
                                         ("EXISTS", deleted_key(self.tenant_id, response_id)))
        if deleted:
            return None, True
        return (decode_row(raw) if raw is not None else None), False

    async def get(self, response_id: str) -> StoredResponse | None:
        row, deleted = await self._recent(response_id)
        if row is not None or deleted:
            return row
        async with database(self.runtime) as session:
            return await ResponseRepository(session, self.tenant_id).get(response_id)

    async def conversation(self, response_id: str) -> list[StoredResponse]:
        """``response_id`` and the responses before it, oldest first (empty if it is not this tenant's):
        the newest links from Redis while they are there, the rest in one recursive query."""
        recent: list[StoredResponse] = []
        current: str | None = response_id
        while current is not None and len(recent) < MAX_CHAIN:
            row, deleted = await self._recent(current)
            if deleted:
                return recent[::-1]
            if row is None:
                break
            recent.append(row)
            current = row.previous_response_id
        older: list[StoredResponse] = []
        if current is not None and len(recent) < MAX_CHAIN:
            async with database(self.runtime) as session:
                older = await ResponseRepository(session, self.tenant_id).conversation(current)
            if older:  # a row deleted while its flush ran is gone for a moment only in Postgres
                flags = await self._redis(*(("EXISTS", deleted_key(self.tenant_id, r.id)) for r in older))
                cut = max((at for at, flag in enumerate(flags) if flag), default=-1)
                older = older[cut + 1:]
        return older + recent[::-1]

    async def delete(self, response_id: str) -> bool:
        """Delete the response; False if there was none (or it was not this tenant's)."""
        _, removed = await self._redis(
            ("SET", deleted_key(self.tenant_id, response_id), b"1", "PX", self._retention_ms),
            ("DEL", response_key(self.tenant_id, response_id)))
        async with database(self.runtime, write=True) as session:
            deleted = await ResponseRepository(session, self.tenant_id).delete(response_id)
        return bool(removed) or deleted


@dataclass
class FlushResult:
    entries: int = 0
    inserted: int = 0
    postponed: bool = False


class ResponseFlusher:
    """Copies the rows named on ``tollgate:responses`` into ``responses``; any number may run at once
    (``INSERT … ON CONFLICT (id) DO NOTHING``)."""

    def __init__(self, redis: Redis, sessions: SessionFactory, *, consumer: str, batch_size: int = 500,
                 claim_idle_ms: int = 60_000) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self._redis = redis
        self._sessions = sessions
        self._group = StreamGroup(redis, RESPONSE_STREAM, FLUSH_GROUP, consumer=consumer,
                                  claim_idle_ms=claim_idle_ms)
        self._batch_size = batch_size

    async def flush(self, max_batches: int = 50) -> FlushResult:
        await self._group.ensure_group()
        total = FlushResult()
        for _ in range(max_batches):
            entries = await self._group.next_entries(self._batch_size)
            if not entries:
                break
            try:
                inserted = await self._flush_batch(entries)
            except (DBAPIError, OSError) as exc:
                logger.warning("stored-response flush postponed, the rows stay in Redis: %r", exc)
                total.postponed = True
                break
            total.entries += len(entries)
            total.inserted += inserted
            if len(entries) < self._batch_size:
                break
        return total

    async def _flush_batch(self, entries: list[tuple[str, dict[bytes, bytes] | None]]) -> int:
        keys = list(dict.fromkeys(fields[KEY_FIELD] for _, fields in entries
                                  if fields and KEY_FIELD in fields))
        rows = [decode_row(raw) for raw in (await self._redis.mget(keys) if keys else []) if raw is not None]
        inserted = await self._insert(rows)
        if rows:  # also after a crash between an earlier commit and this check: re-check every row
            flags = await self._deleted(rows)
            gone = [row.id for row, flag in zip(rows, flags, strict=True) if flag]
            if gone:
                async with self._sessions() as session, session.begin():
                    await session.execute(delete(StoredResponse).where(StoredResponse.id.in_(gone)))

        def keep_recent(pipe: Pipeline) -> None:
            for key in keys:
                pipe.expire(key, RECENT_S, lt=True)

        await self._group.acknowledge([entry_id for entry_id, _ in entries], keep_recent)
        return inserted

    async def _deleted(self, rows: list[StoredResponse]) -> list[bool]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for row in rows:
                pipe.exists(deleted_key(row.tenant_id, row.id))
            return [bool(flag) for flag in await pipe.execute()]

    async def _insert(self, rows: list[StoredResponse]) -> int:
        """Insert the rows in one transaction; on a constraint violation (a tenant or key deleted
        meanwhile) row by row: a row whose key is gone is kept without it, one whose tenant is gone is
        dropped (its responses went with it)."""
        if not rows:
            return 0
        try:
            return await self._insert_rows([row_values(row) for row in rows])
        except IntegrityError:
            pass
        inserted = 0
        for row in rows:
            values = row_values(row)
            for attempt in (values, {**values, "api_key_id": None}):
                try:
                    inserted += await self._insert_rows([attempt])
                    break
                except IntegrityError:
                    continue
            else:
                logger.warning("stored response %s dropped: its tenant %s is gone", row.id, row.tenant_id)
        return inserted

    async def _insert_rows(self, values: list[dict[str, Any]]) -> int:
        statement = insert(RESPONSES).on_conflict_do_nothing(index_elements=["id"])
        async with self._sessions() as session, session.begin():
            result = await session.execute(statement.returning(RESPONSES.c.id), values)
            return len(result.all())
